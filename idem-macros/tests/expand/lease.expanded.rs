async fn charge_once<'a, __IdemDb: ::idem::__private::Backend>(
    store: &::idem::__private::Store<__IdemDb>,
    job: &'a Charge,
    http: &reqwest::Client,
) -> Result<::idem::__private::Outcome<Receipt>, AppError> {
    let __idem_key = ::idem::__private::key(&(job.id));
    static __IDEM_SPEC: ::idem::__private::LeaseSpec = ::idem::__private::LeaseSpec::new(
        "billing.charge",
        "charge_once",
        ::idem::__private::LeaseOptions::new(
                ::idem::__private::Duration::from_millis(30000),
            )
            .timeout(::idem::__private::Duration::from_millis(10000)),
    );
    let __idem_outcome = async move {
        let __idem_lease = match ::idem::__private::lease(
                store,
                &__IDEM_SPEC,
                __idem_key,
                ::core::option::Option::None,
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
                return ::core::result::Result::Ok(::idem::__private::Outcome::Duplicate);
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
        ::idem::__private::lease_finish(
                ::core::option::Option::None,
                __idem_lease,
                __idem_result,
                ::core::option::Option::None,
            )
            .await
    }
        .await;
    ::idem::__private::settle(__idem_outcome)
}
