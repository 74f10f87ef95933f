//! The attribute's compile-error cases with idem built for every database: see `tests/ui.rs`.
