async fn send_mail<__IdemDb: ::idem::__private::Backend>(
    store: &::idem::__private::Store<__IdemDb>,
    job: &Mail,
    api: &MailApi,
) -> Result<::idem::__private::Outcome<MessageId>, AppError> {
    let __idem_codec = {
        use ::idem::__private::{ReplayCodec as _, ReplayFallback as _};
        (&::idem::__private::Replay::<MessageId>::new()).codec()
    };
    let __idem_key = ::idem::__private::key(&(job.id));
    let __idem_print = ::core::option::Option::Some(
        ::idem::__private::fingerprint(&(job.body)),
    );
    static __IDEM_SPEC: ::idem::__private::LeaseSpec = ::idem::__private::LeaseSpec::new(
        "mail.send",
        "send_mail",
        ::idem::__private::LeaseOptions::new(
                ::idem::__private::Duration::from_millis(60000),
            )
            .replay(),
    );
    let __idem_outcome = async move {
        let __idem_lease = match ::idem::__private::lease(
                store,
                &__IDEM_SPEC,
                __idem_key,
                __idem_print,
                ::core::option::Option::None,
            )
            .await
        {
            ::core::result::Result::Ok(
                ::idem::__private::Claimed::Fresh(__idem_lease),
            ) => __idem_lease,
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
        let __idem_lease_ref = &__idem_lease;
        let __idem_result = ::idem::__private::Lease::run(
                &__idem_lease,
                async move {
                    let __idem_body: Result<MessageId, AppError> = async move {
                        let lease: &idem::Lease = __idem_lease_ref;
                        api.send(lease.idempotency_key(), &job.body).await
                    }
                        .await;
                    __idem_body
                },
            )
            .await;
        ::idem::__private::lease_finish(
                ::core::option::Option::Some(__idem_codec),
                __idem_lease,
                __idem_result,
                ::core::option::Option::None,
            )
            .await
    }
        .await;
    ::idem::__private::settle(__idem_outcome)
}
