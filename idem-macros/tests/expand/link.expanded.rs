// if_sqlite: the handler when the database's feature is on
async fn ship(
    store: impl ::idem::__private::Target<Sqlite>,
    msg: &Message,
) -> Result<::idem::__private::Outcome<()>, sqlx::Error> {
    let __idem_key = ::idem::__private::key(&(msg.id));
    let __idem_link = ::idem::__private::link(&(msg.traceparent));
    static __IDEM_SPEC: ::idem::__private::Spec = ::idem::__private::Spec::new(
        "orders.ship",
        "ship",
        ::idem::__private::ClaimOptions::new(),
    );
    let __idem_outcome = async move {
        let mut __idem_held = match ::idem::__private::claim(
                store,
                &__IDEM_SPEC,
                __idem_key,
                ::core::option::Option::None,
                __idem_link,
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
        let __idem_result: Result<(), sqlx::Error> = ::idem::__private::Body::run(
                __idem_body_of,
                async move {
                    let tx: &mut Transaction<'_, Sqlite> = __idem_tx;
                    sqlx::query("INSERT INTO shipments (id) VALUES (?)")
                        .bind(&msg.id)
                        .execute(&mut **tx)
                        .await?;
                    Ok(())
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
#[allow(unused_variables)]
fn ship(
    store: impl ::core::marker::Sized,
    msg: &Message,
) -> ::core::future::Pending<Result<::idem::__private::Outcome<()>, sqlx::Error>> {
    let _: ::core::option::Option<&mut Transaction<'_, Sqlite>> = ::core::option::Option::None;
    ::core::future::pending()
}
