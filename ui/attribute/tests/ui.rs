//! Every misuse of `#[idempotent]` is a compile error on the user's own tokens; these cases pin
//! the messages. Re-bless with
//! `TRYBUILD=overwrite cargo test -p idem-ui-attribute`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*/*.rs");
}
