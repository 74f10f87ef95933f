// if_postgres: the handler when the database's feature is on
pub async fn apply_top_ups(
    store: &::idem::__private::Store<Postgres>,
    jobs: &[TopUp],
) -> Result<::idem::__private::Batch<usize>, AppError> {
    static __IDEM_SPEC: ::idem::__private::Spec = ::idem::__private::Spec::new(
        "billing.top_up",
        "apply_top_ups",
        ::idem::__private::ClaimOptions::new(),
    );
    let __idem_keys = ::idem::__private::batch_keys(
        ::core::iter::Iterator::map(
            ::core::iter::IntoIterator::into_iter(jobs),
            |job| ::idem::__private::Key::new(&(job.id)),
        ),
    );
    let __idem_jobs = <[_]>::len(jobs);
    let __idem_outcome = async move {
        let mut __idem_claim = match ::idem::__private::claim_batch(
                store,
                &__IDEM_SPEC,
                __idem_keys,
                __idem_jobs,
            )
            .await
        {
            ::core::result::Result::Ok(__idem_claim) => __idem_claim,
            ::core::result::Result::Err(__idem_err) => {
                return ::core::result::Result::Err(
                    ::idem::__private::Failed::Idem(__idem_err),
                );
            }
        };
        if !__idem_claim.any_fresh() {
            return ::core::result::Result::Ok(
                ::idem::__private::all_duplicates(&__idem_claim),
            );
        }
        let __idem_fresh = ::idem::__private::fresh_jobs(jobs, &__idem_claim);
        let (__idem_body_of, __idem_tx, _) = ::idem::__private::batch_open(
            &mut __idem_claim,
        );
        let __idem_result: Result<usize, AppError> = ::idem::__private::Body::run(
                __idem_body_of,
                async move {
                    let tx: &mut sqlx::Transaction<'_, Postgres> = __idem_tx;
                    let jobs: &[TopUp] = &*__idem_fresh;
                    for job in jobs {
                        sqlx::query(
                                "UPDATE accounts SET credits = credits + $1 WHERE id = $2",
                            )
                            .bind(job.credits)
                            .bind(job.account_id)
                            .execute(&mut **tx)
                            .await?;
                    }
                    Ok(jobs.len())
                },
            )
            .await;
        ::idem::__private::finish_batch(__idem_claim, __idem_result).await
    }
        .await;
    ::idem::__private::settle(__idem_outcome)
}

// if_postgres: the stand-in when it is off
::core::compile_error!(
    "this build of idem cannot keep markers in this database: enable idem's `postgres` feature, e.g. `idem = { version = \"..\", features = [\"postgres\"] }`"
);
#[allow(unused_variables)]
pub fn apply_top_ups(
    store: impl ::core::marker::Sized,
    jobs: &[TopUp],
) -> ::core::future::Pending<Result<::idem::__private::Batch<usize>, AppError>> {
    let _: ::core::option::Option<&mut sqlx::Transaction<'_, Postgres>> = ::core::option::Option::None;
    ::core::future::pending()
}
