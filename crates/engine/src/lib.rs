//! redlite-engine
