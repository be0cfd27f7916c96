//! Token sampling: greedy, temperature, top-k, top-p, min-p, penalties, seeded RNG.
