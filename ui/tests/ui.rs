//! The compile errors that need idem with some features off (a database) or on (the HTTP
//! layer): one error for each mistake, at the user's token. Re-bless with
//! `TRYBUILD=overwrite cargo test -p idem-ui`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/cases/*.rs");
}
