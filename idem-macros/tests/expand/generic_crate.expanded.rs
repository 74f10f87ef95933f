// if_mysql: the handler when the database's feature is on
pub(crate) async fn handle<J: Job + Sync>(
    job: &J,
    store: impl ::my_app::idem::__private::Target<MySql>,
) -> Result<::my_app::idem::__private::Outcome<J::Output>, sqlx::Error>
where
    J::Output: Send,
{
    let __idem_key = ::my_app::idem::__private::key(&(job.key()));
    let __idem_via = ::my_app::idem::__private::via(store, "handle");
    let __idem_call = ::my_app::idem::__private::observe(
        {
            static __IDEM_SITE: ::my_app::idem::__private::Site = ::my_app::idem::__private::Site::new(
                "jobs.handle",
            );
            &__IDEM_SITE
        },
        ::my_app::idem::__private::mode(&__idem_via),
        &__idem_key,
    );
    let __idem_outcome = ::my_app::idem::__private::Call::run(
            __idem_call,
            ::my_app::idem::__private::in_body(
                "handle",
                async move {
                    let mut __idem_guard = match ::my_app::idem::__private::claim(
                            __idem_via,
                            "jobs.handle",
                            ::my_app::idem::__private::ClaimOptions::new(),
                            __idem_key,
                        )
                        .await
                    {
                        ::core::result::Result::Ok(
                            ::my_app::idem::__private::Claimed::Fresh(__idem_guard),
                        ) => __idem_guard,
                        ::core::result::Result::Ok(
                            ::my_app::idem::__private::Claimed::Duplicate,
                        ) => {
                            return ::core::result::Result::Ok(
                                ::my_app::idem::__private::Outcome::Duplicate,
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
                    let __idem_tx = __idem_guard.tx();
                    let __idem_result: Result<J::Output, sqlx::Error> = async move {
                        let mut tx: &mut sqlx::Transaction<'_, MySql> = __idem_tx;
                        job.run(&mut tx).await
                    }
                        .await;
                    ::my_app::idem::__private::finish(__idem_guard, __idem_result).await
                },
            ),
        )
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
