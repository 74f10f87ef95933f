// if_sqlite: the handler when the database's feature is on
async fn record_payment(
    store: impl ::idem::__private::Target<Sqlite>,
    event: &PaymentEvent,
) -> Result<::idem::__private::Outcome<Receipt>, AppError> {
    let __idem_codec = {
        use ::idem::__private::{ReplayCodec as _, ReplayFallback as _};
        (&::idem::__private::Replay::<Receipt>::new()).codec()
    };
    let __idem_key = ::idem::__private::key(&(event.id));
    let __idem_print = ::core::option::Option::Some(
        ::idem::__private::fingerprint(&(event)),
    );
    static __IDEM_SPEC: ::idem::__private::Spec = ::idem::__private::Spec::new(
        "webhooks.payment",
        "record_payment",
        ::idem::__private::ClaimOptions::new().replay(),
    );
    let __idem_outcome = async move {
        let mut __idem_held = match ::idem::__private::claim(
                store,
                &__IDEM_SPEC,
                __idem_key,
                __idem_print,
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
                return ::idem::__private::replayed(__idem_codec, &__idem_recorded);
            }
            ::core::result::Result::Err(__idem_err) => {
                return ::core::result::Result::Err(
                    ::idem::__private::Failed::Idem(__idem_err),
                );
            }
        };
        let __idem_body_of = __idem_held.body();
        let __idem_tx = __idem_held.tx();
        let __idem_result: Result<Receipt, AppError> = ::idem::__private::Body::run(
                __idem_body_of,
                async move {
                    let tx: &mut Transaction<'_, Sqlite> = __idem_tx;
                    sqlx::query("INSERT INTO payments (id, amount) VALUES (?1, ?2)")
                        .bind(&event.id)
                        .bind(event.amount)
                        .execute(&mut **tx)
                        .await?;
                    Ok(Receipt::for_event(event))
                },
            )
            .await;
        ::idem::__private::finish(
                ::core::option::Option::Some(__idem_codec),
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
#[allow(unused_variables)]
fn record_payment(
    store: impl ::core::marker::Sized,
    event: &PaymentEvent,
) -> ::core::future::Pending<Result<::idem::__private::Outcome<Receipt>, AppError>> {
    let _: ::core::option::Option<&mut Transaction<'_, Sqlite>> = ::core::option::Option::None;
    ::core::future::pending()
}
