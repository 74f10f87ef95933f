pub(crate) async fn handle<J: Job + Sync>(
    job: &J,
    store: &::my_app::idem::__private::Store<MySql>,
) -> Result<::my_app::idem::__private::Outcome<J::Output>, sqlx::Error>
where
    J::Output: Send,
{
    let __idem_key = ::my_app::idem::__private::key(&(job.key()));
    let __idem_outcome = async move {
        let mut __idem_guard = match ::my_app::idem::__private::claim(
                store,
                "jobs.handle",
                ::my_app::idem::__private::ClaimOptions::new(),
                __idem_key,
            )
            .await
        {
            ::core::result::Result::Ok(
                ::my_app::idem::__private::Claim::Fresh(__idem_guard),
            ) => __idem_guard,
            ::core::result::Result::Ok(::my_app::idem::__private::Claim::Duplicate) => {
                return ::core::result::Result::Ok(
                    ::my_app::idem::__private::Outcome::Duplicate,
                );
            }
            ::core::result::Result::Ok(
                ::my_app::idem::__private::Claim::Replayed(__idem_recorded),
            ) => {
                return ::core::result::Result::Ok(
                    ::my_app::idem::__private::Outcome::Duplicate,
                );
            }
            ::core::result::Result::Err(__idem_err) => {
                return ::core::result::Result::Err(
                    ::my_app::idem::__private::Failed::Idem(__idem_err),
                );
            }
        };
        let __idem_tx = __idem_guard.tx();
        let __idem_result: Result<J::Output, sqlx::Error> = async move {
            let mut tx: &mut sqlx::Transaction<'_, MySql> = __idem_tx;
            job.run(&mut tx).await
        }
            .await;
        ::my_app::idem::__private::finish(__idem_guard, __idem_result).await
    }
        .await;
    ::my_app::idem::__private::settle(__idem_outcome)
}
