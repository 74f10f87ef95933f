// if_postgres: the handler when the database's feature is on
pub async fn refund(
    store: impl ::idem::__private::Target<::idem::__private::db::Postgres>,
    job: &Refund,
) -> ::core::result::Result<
    ::idem::__private::Outcome<<Fallible<u64> as ::idem::__private::HandlerResult>::Ok>,
    <Fallible<u64> as ::idem::__private::HandlerResult>::Err,
> {
    let __idem_key = ::idem::__private::key(&(&(job.tenant), &(job.id)));
    static __IDEM_SPEC: ::idem::__private::Spec = ::idem::__private::Spec::new(
        "billing.refund",
        "refund",
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
        let __idem_result: Fallible<u64> = ::idem::__private::Body::run(
                __idem_body_of,
                async move {
                    let tx: &mut sqlx::postgres::PgTransaction<'_> = __idem_tx;
                    sqlx::query(
                            "UPDATE accounts SET credits = credits - $1 WHERE id = $2",
                        )
                        .bind(job.credits)
                        .bind(job.account_id)
                        .execute(&mut **tx)
                        .await?;
                    Ok(job.credits)
                },
            )
            .await;
        let __idem_result = {
            use ::idem::__private::{IntoResult as _, NotAResult as _};
            ::idem::__private::Returned(__idem_result).into_result()
        };
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

// if_postgres: the stand-in when it is off
::core::compile_error!(
    "this build of idem cannot keep markers in this database: enable idem's `postgres` feature, e.g. `idem = { version = \"..\", features = [\"postgres\"] }`"
);
#[allow(unused_variables)]
pub fn refund(
    store: impl ::core::marker::Sized,
    job: &Refund,
) -> ::core::future::Pending<
    ::core::result::Result<
        ::idem::__private::Outcome<
            <Fallible<u64> as ::idem::__private::HandlerResult>::Ok,
        >,
        <Fallible<u64> as ::idem::__private::HandlerResult>::Err,
    >,
> {
    let _: ::core::option::Option<&mut sqlx::postgres::PgTransaction<'_>> = ::core::option::Option::None;
    ::core::future::pending()
}
