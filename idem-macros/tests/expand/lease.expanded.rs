async fn charge_once<'a, __IdemDb: ::idem::__private::Backend>(
    store: &::idem::__private::Store<__IdemDb>,
    job: &'a Charge,
    http: &reqwest::Client,
) -> Result<::idem::__private::Outcome<Receipt>, AppError> {
    let __idem_key = ::idem::__private::key(&(job.id));
    let __idem_call = ::idem::__private::observe(
        {
            static __IDEM_SITE: ::idem::__private::Site = ::idem::__private::Site::new(
                "billing.charge",
            );
            &__IDEM_SITE
        },
        ::idem::__private::Mode::Lease,
        &__idem_key,
    );
    let __idem_outcome = ::idem::__private::Call::run(
            __idem_call,
            async move {
                let __idem_lease = match ::idem::__private::lease(
                        store,
                        "billing.charge",
                        const {
                            ::idem::__private::LeaseOptions::new(
                                    ::idem::__private::Duration::from_millis(30000),
                                )
                                .timeout(::idem::__private::Duration::from_millis(10000))
                        },
                        __idem_key,
                    )
                    .await
                {
                    ::core::result::Result::Ok(
                        ::idem::__private::Leased::Fresh(__idem_lease),
                    ) => __idem_lease,
                    ::core::result::Result::Ok(::idem::__private::Leased::Duplicate) => {
                        return ::core::result::Result::Ok(
                            ::idem::__private::Outcome::Duplicate,
                        );
                    }
                    ::core::result::Result::Ok(
                        ::idem::__private::Leased::Replayed(__idem_recorded),
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
                let __idem_lease_ref = &__idem_lease;
                let __idem_result = ::idem::__private::lease_run(
                        &__idem_lease,
                        async move {
                            let __idem_body: Result<Receipt, AppError> = async move {
                                let lease: &idem::Lease = __idem_lease_ref;
                                let receipt = http
                                    .post("https://pay.example/charges")
                                    .header("Idempotency-Key", lease.idempotency_key())
                                    .timeout(lease.remaining())
                                    .send()
                                    .await?;
                                Ok(receipt.json().await?)
                            }
                                .await;
                            __idem_body
                        },
                    )
                    .await;
                ::idem::__private::lease_finish(__idem_lease, __idem_result).await
            },
        )
        .await;
    ::idem::__private::settle(__idem_outcome)
}
