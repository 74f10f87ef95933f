// if_mysql: the handler when the database's feature is on
pub(crate) async fn handle<J: Job + Sync>(
    job: &J,
    store: impl ::my_app::idem::__private::Target<MySql>,
) -> Result<::my_app::idem::__private::Outcome<J::Output>, sqlx::Error>
where
    J::Output: Send,
{
    let __idem_key = ::my_app::idem::__private::key(&(job.key()));
    static __IDEM_SPEC: ::my_app::idem::__private::Spec = ::my_app::idem::__private::Spec::new(
        "jobs.handle",
        "handle",
        ::my_app::idem::__private::ClaimOptions::new(),
    );
    let __idem_outcome = async move {
        let mut __idem_held = match ::my_app::idem::__private::claim(
                store,
                &__IDEM_SPEC,
                __idem_key,
                ::core::option::Option::None,
                ::core::option::Option::None,
            )
            .await
        {
            ::core::result::Result::Ok(
                ::my_app::idem::__private::Claimed::Fresh(__idem_held),
            ) => __idem_held,
            ::core::result::Result::Ok(
                ::my_app::idem::__private::Claimed::Duplicate,
            ) => {
                return ::core::result::Result::Ok(
                    ::my_app::idem::__private::Outcome::Duplicate,
                );
            }
            ::core::result::Result::Ok(
                ::my_app::idem::__private::Claimed::Failed(__idem_err),
            ) => {
                return ::core::result::Result::Ok(
                    ::my_app::idem::__private::Outcome::Failed(__idem_err),
                );
            }
            ::core::result::Result::Ok(
                ::my_app::idem::__private::Claimed::Replayed(__idem_recorded),
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
        let __idem_body_of = __idem_held.body();
        let __idem_tx = __idem_held.tx();
        let __idem_result: Result<J::Output, sqlx::Error> = ::my_app::idem::__private::Body::run(
                __idem_body_of,
                async move {
                    let mut tx: &mut sqlx::Transaction<'_, MySql> = __idem_tx;
                    job.run(&mut tx).await
                },
            )
            .await;
        ::my_app::idem::__private::finish(
                ::core::option::Option::None,
                __idem_held,
                __idem_result,
            )
            .await
    }
        .await;
    ::my_app::idem::__private::settle(__idem_outcome)
}

// if_mysql: the stand-in when it is off
::core::compile_error!(
    "this build of idem cannot keep markers in this database: enable idem's `mysql` feature, e.g. `idem = { version = \"..\", features = [\"mysql\"] }`"
);
#[allow(unused_variables)]
pub(crate) fn handle<J: Job + Sync>(
    job: &J,
    store: impl ::core::marker::Sized,
) -> ::core::future::Pending<
    Result<::my_app::idem::__private::Outcome<J::Output>, sqlx::Error>,
>
where
    J::Output: Send,
{
    let _: ::core::option::Option<&mut sqlx::Transaction<'_, MySql>> = ::core::option::Option::None;
    ::core::future::pending()
}
