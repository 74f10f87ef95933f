// if_postgres: the handler when the database's feature is on
pub async fn top_up_each(
    store: &::idem::__private::Store<Postgres>,
    job: &[TopUp],
) -> Result<::idem::__private::Each<i64, AppError>, AppError> {
    static __IDEM_SPEC: ::idem::__private::Spec = ::idem::__private::Spec::new(
        "billing.top_up",
        "top_up_each",
        ::idem::__private::ClaimOptions::new(),
    );
    let __idem_keys = ::idem::__private::batch_keys(
        ::core::iter::Iterator::map(
            ::core::iter::IntoIterator::into_iter(job),
            |job| ::idem::__private::Key::new(&(job.id)),
        ),
    );
    let __idem_jobs = <[_]>::len(job);
    let __idem_outcome = async move {
        let mut __idem_claim = match ::idem::__private::claim_batch(
                store,
                &__IDEM_SPEC,
                __idem_keys,
                __idem_jobs,
            )
            .await
        {
            ::core::result::Result::Ok(__idem_claim) => {
                ::idem::__private::BatchGuard::each(__idem_claim)
            }
            ::core::result::Result::Err(__idem_err) => {
                return ::core::result::Result::Err(
                    ::idem::__private::Failed::Idem(__idem_err),
                );
            }
        };
        if let ::core::option::Option::Some(__idem_span) = ::idem::__private::EachGuard::body(
            &__idem_claim,
        ) {
            for (__idem_at, job) in ::core::iter::Iterator::enumerate(
                ::core::iter::IntoIterator::into_iter(job),
            ) {
                let mut __idem_job = match ::idem::__private::EachGuard::job(
                        &mut __idem_claim,
                        __idem_at,
                    )
                    .await
                {
                    ::core::result::Result::Ok(
                        ::core::option::Option::Some(__idem_job),
                    ) => __idem_job,
                    ::core::result::Result::Ok(::core::option::Option::None) => continue,
                    ::core::result::Result::Err(__idem_err) => {
                        return ::core::result::Result::Err(
                            ::idem::__private::Failed::Handler(__idem_err),
                        );
                    }
                };
                let __idem_body_of = ::core::clone::Clone::clone(&__idem_span);
                let (__idem_tx, __idem_outbox_ref) = ::idem::__private::JobGuard::parts(
                    &mut __idem_job,
                );
                let __idem_result: Result<i64, AppError> = ::idem::__private::Body::run(
                        __idem_body_of,
                        async {
                            let tx: &mut sqlx::Transaction<'_, Postgres> = __idem_tx;
                            let job: &TopUp = job;
                            let outbox: &mut idem::Outbox = __idem_outbox_ref;
                            sqlx::query(
                                    "UPDATE accounts SET credits = credits + $1 WHERE id = $2",
                                )
                                .bind(job.credits)
                                .bind(job.account_id)
                                .execute(&mut **tx)
                                .await?;
                            outbox.send("credits", &job.credits)?;
                            Ok(job.credits)
                        },
                    )
                    .await;
                if let ::core::result::Result::Err(__idem_err) = ::idem::__private::JobGuard::finish(
                        __idem_job,
                        __idem_result,
                    )
                    .await
                {
                    return ::core::result::Result::Err(
                        ::idem::__private::Failed::Handler(__idem_err),
                    );
                }
            }
        }
        ::idem::__private::finish_each(__idem_claim).await
    }
        .await;
    ::idem::__private::settle(__idem_outcome)
}

// if_postgres: the stand-in when it is off
::core::compile_error!(
    "this build of idem cannot keep markers in this database: enable idem's `postgres` feature, e.g. `idem = { version = \"..\", features = [\"postgres\"] }`"
);
#[allow(unused_variables)]
pub fn top_up_each(
    store: impl ::core::marker::Sized,
    job: &[TopUp],
) -> ::core::future::Pending<Result<::idem::__private::Each<i64, AppError>, AppError>> {
    let _: ::core::option::Option<&mut sqlx::Transaction<'_, Postgres>> = ::core::option::Option::None;
    ::core::future::pending()
}
