// if_postgres: the handler when the database's feature is on
pub async fn top_up_grouped(
    store: &dyn ::idem::__private::GroupTarget<Postgres>,
    job: &TopUp,
) -> Result<::idem::__private::Outcome<()>, AppError> {
    let __idem_key = ::idem::__private::key(&(job.id));
    static __IDEM_SPEC: ::idem::__private::Spec = ::idem::__private::Spec::new(
        "billing.top_up",
        "top_up_grouped",
        ::idem::__private::ClaimOptions::new(),
    );
    let __idem_outcome = async move {
        let mut __idem_held = match ::idem::__private::claim_group(
                ::idem::__private::GroupTarget::as_group(store),
                &__IDEM_SPEC,
                __idem_key,
                ::core::option::Option::None,
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
        let __idem_result: Result<(), AppError> = ::idem::__private::Body::bounded(
                __idem_body_of,
                async move {
                    let tx: &mut sqlx::Transaction<'_, Postgres> = __idem_tx;
                    sqlx::query(
                            "UPDATE accounts SET credits = credits + $1 WHERE id = $2",
                        )
                        .bind(job.credits)
                        .bind(job.account_id)
                        .execute(&mut **tx)
                        .await?;
                    Ok(())
                },
            )
            .await;
        ::idem::__private::finish_group(
                ::core::option::Option::None,
                __idem_held,
                __idem_result,
            )
            .await
    }
        .await;
    ::idem::__private::settle(__idem_outcome)
}

// if_postgres: the stand-in when it is off
::core::compile_error!(
    "this build of idem cannot keep markers in this database: enable idem's `postgres` feature, e.g. `idem = { version = \"..\", features = [\"postgres\"] }`"
);
#[allow(unused_variables)]
pub fn top_up_grouped(
    store: impl ::core::marker::Sized,
    job: &TopUp,
) -> ::core::future::Pending<Result<::idem::__private::Outcome<()>, AppError>> {
    let _: ::core::option::Option<&mut sqlx::Transaction<'_, Postgres>> = ::core::option::Option::None;
    ::core::future::pending()
}
