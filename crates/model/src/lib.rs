//! redlite-model
