// if_sqlite: the handler when the database's feature is on
/// Sends the receipt of one order.
/**

*Idempotent* (scope `billing.receipt`): the effect commits once per key; a later delivery of the same key returns `Outcome::Duplicate` without running.*/
async fn send_receipt(
    &self,
    order: Order,
    store: impl ::idem::__private::Target<Sqlite>,
) -> anyhow::Result<::idem::__private::Outcome<u64>> {
    let __idem_key = ::idem::__private::key(&(&(self.tenant), &(order.id)));
    static __IDEM_SPEC: ::idem::__private::Spec = ::idem::__private::Spec::new(
        "billing.receipt",
        "send_receipt",
        ::idem::__private::ClaimOptions::new(),
    );
    let __idem_outcome = async move {
        let mut __idem_held = match ::idem::__private::claim(
                store,
                &__IDEM_SPEC,
                __idem_key,
                ::core::option::Option::None,
                ::core::option::Option::None,
            )
            .await
        {
            ::core::result::Result::Ok(
                ::idem::__private::Claimed::Fresh(__idem_held),
            ) => __idem_held,
            ::core::result::Result::Ok(::idem::__private::Claimed::Duplicate) => {
                return ::core::result::Result::Ok(::idem::__private::Outcome::Duplicate);
            }
            ::core::result::Result::Ok(
                ::idem::__private::Claimed::Failed(__idem_err),
            ) => {
                return ::core::result::Result::Ok(
                    ::idem::__private::Outcome::Failed(__idem_err),
                );
            }
            ::core::result::Result::Ok(
                ::idem::__private::Claimed::Replayed(__idem_recorded),
            ) => {
                return ::core::result::Result::Ok(::idem::__private::Outcome::Duplicate);
            }
            ::core::result::Result::Err(__idem_err) => {
                return ::core::result::Result::Err(
                    ::idem::__private::Failed::Idem(__idem_err),
                );
            }
        };
        let __idem_body_of = __idem_held.body();
        let __idem_tx = __idem_held.tx();
        let __idem_result: anyhow::Result<u64> = ::idem::__private::Body::run(
                __idem_body_of,
                async move {
                    let tx: &mut idem::Tx<'_, Sqlite> = __idem_tx;
                    if order.total == 0 {
                        return Ok(0);
                    }
                    Ok(order.total)
                },
            )
            .await;
        ::idem::__private::finish(
                ::core::option::Option::None,
                __idem_held,
                __idem_result,
            )
            .await
    }
        .await;
    ::idem::__private::settle(__idem_outcome)
}

// if_sqlite: the stand-in when it is off
::core::compile_error!(
    "this build of idem cannot keep markers in this database: enable idem's `sqlite` feature, e.g. `idem = { version = \"..\", features = [\"sqlite\"] }`"
);
/// Sends the receipt of one order.
/**

*Idempotent* (scope `billing.receipt`): the effect commits once per key; a later delivery of the same key returns `Outcome::Duplicate` without running.*/
#[allow(unused_variables)]
fn send_receipt(
    &self,
    order: Order,
    store: impl ::core::marker::Sized,
) -> ::core::future::Pending<anyhow::Result<::idem::__private::Outcome<u64>>> {
    let _: ::core::option::Option<&mut idem::Tx<'_, Sqlite>> = ::core::option::Option::None;
    ::core::future::pending()
}
