// if_mysql: the handler when the database's feature is on
async fn post(
    store: impl ::idem::__private::Target<MySql>,
    job: &Entry,
) -> Result<::idem::__private::Outcome<()>, sqlx::Error> {
    let __idem_key = ::idem::__private::key(&(job.id));
    let __idem_via = ::idem::__private::via(store, "post");
    let __idem_call = ::idem::__private::observe(
        {
            static __IDEM_SITE: ::idem::__private::Site = ::idem::__private::Site::new(
                "ledger.post",
            );
            &__IDEM_SITE
        },
        ::idem::__private::mode(&__idem_via),
        &__idem_key,
    );
    let __idem_outcome = ::idem::__private::Call::run(
            __idem_call,
            ::idem::__private::in_body(
                "post",
                async move {
                    let mut __idem_guard = match ::idem::__private::claim(
                            __idem_via,
                            "ledger.post",
                            ::idem::__private::ClaimOptions::new()
                                .wait(::idem::__private::Duration::from_millis(500))
                                .isolation(::idem::__private::Isolation::Serializable),
                            __idem_key,
                        )
                        .await
                    {
                        ::core::result::Result::Ok(
                            ::idem::__private::Claimed::Fresh(__idem_guard),
                        ) => __idem_guard,
                        ::core::result::Result::Ok(
                            ::idem::__private::Claimed::Duplicate,
                        ) => {
                            return ::core::result::Result::Ok(
                                ::idem::__private::Outcome::Duplicate,
                            );
                        }
                        ::core::result::Result::Ok(
                            ::idem::__private::Claimed::Replayed(__idem_recorded),
                        ) => {
                            return ::core::result::Result::Ok(
                                ::idem::__private::Outcome::Duplicate,
                            );
                        }
                        ::core::result::Result::Err(__idem_err) => {
                            return ::core::result::Result::Err(
                                ::idem::__private::Failed::Idem(__idem_err),
                            );
                        }
                    };
                    let __idem_tx = __idem_guard.tx();
                    let __idem_result: Result<(), sqlx::Error> = async move {
                        let tx: &mut sqlx::Transaction<'_, MySql> = __idem_tx;
                        Ok(())
                    }
                        .await;
                    ::idem::__private::finish(__idem_guard, __idem_result).await
                },
            ),
        )
        .await;
    ::idem::__private::settle(__idem_outcome)
}

// if_mysql: the stand-in when it is off
::core::compile_error!(
    "this build of idem cannot keep markers in this database: enable idem's `mysql` feature, e.g. `idem = { version = \"..\", features = [\"mysql\"] }`"
);
#[allow(unused_variables)]
fn post(
    store: impl ::core::marker::Sized,
    job: &Entry,
) -> ::core::future::Pending<Result<::idem::__private::Outcome<()>, sqlx::Error>> {
    let _: ::core::option::Option<&mut sqlx::Transaction<'_, MySql>> = ::core::option::Option::None;
    ::core::future::pending()
}
