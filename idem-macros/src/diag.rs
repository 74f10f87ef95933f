//! Collects every mistake so that one compile shows them all (as serde's `Ctxt`).

use std::fmt::Display;

use quote::ToTokens;

#[derive(Default)]
pub(crate) struct Diag {
    errors: Option<syn::Error>,
}

impl Diag {
    pub(crate) fn push(&mut self, err: syn::Error) {
        match &mut self.errors {
            Some(all) => all.combine(err),
            None => self.errors = Some(err),
        }
    }

    /// An error on the tokens of `at` (the narrowest node that shows the mistake).
    pub(crate) fn error(&mut self, at: impl ToTokens, msg: impl Display) {
        self.push(syn::Error::new_spanned(at, msg));
    }

    pub(crate) fn error_at(&mut self, span: proc_macro2::Span, msg: impl Display) {
        self.push(syn::Error::new(span, msg));
    }

    pub(crate) fn finish(self) -> Result<(), syn::Error> {
        match self.errors {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
