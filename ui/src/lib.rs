//! Compile-error cases for idem built with SQLite and the HTTP layer only: see `tests/ui.rs`.
