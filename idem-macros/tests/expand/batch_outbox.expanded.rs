// if_postgres: the handler when the database's feature is on
pub async fn place_all(
    store: &::idem::__private::Store<Postgres>,
    orders: &[Order],
) -> Result<::idem::__private::Batch<()>, AppError> {
    let __idem_keys = ::idem::__private::batch_keys(
        "place_all",
        ::core::iter::Iterator::map(
            ::core::iter::IntoIterator::into_iter(orders),
            |order| ::idem::__private::batch_key(&(order.id)),
        ),
    );
    let __idem_call = ::idem::__private::observe_batch({
        static __IDEM_SITE: ::idem::__private::Site = ::idem::__private::Site::new(
            "orders.place",
        );
        &__IDEM_SITE
    });
    let __idem_jobs = <[_]>::len(orders);
    let __idem_outcome = ::idem::__private::Call::run_batch(
            __idem_call,
            __idem_jobs,
            ::idem::__private::in_body(
                "place_all",
                async move {
                    let (mut __idem_claim, mut __idem_outbox) = match ::idem::__private::claim_batch_sending(
                            store,
                            "orders.place",
                            ::idem::__private::ClaimOptions::new(),
                            __idem_keys,
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
                    let __idem_fresh = ::idem::__private::fresh_jobs(
                        orders,
                        &__idem_claim,
                    );
                    let __idem_outbox_ref = &mut __idem_outbox;
                    let __idem_tx = ::idem::__private::batch_tx(&mut __idem_claim);
                    let __idem_result: Result<(), AppError> = async move {
                        let tx: &mut sqlx::Transaction<'_, Postgres> = __idem_tx;
                        let orders: &[Order] = &*__idem_fresh;
                        let outbox: &mut idem::BatchOutbox = __idem_outbox_ref;
                        for order in orders {
                            sqlx::query("INSERT INTO orders (id) VALUES ($1)")
                                .bind(order.id)
                                .execute(&mut **tx)
                                .await?;
                            outbox.send(&order.id, "shipping", &order.id)?;
                        }
                        Ok(())
                    }
                        .await;
                    ::idem::__private::finish_batch_sending(
                            __idem_claim,
                            __idem_result,
                            __idem_outbox,
                        )
                        .await
                },
            ),
        )
        .await;
    ::idem::__private::settle_batch(__idem_outcome)
}

// if_postgres: the stand-in when it is off
::core::compile_error!(
    "this build of idem cannot keep markers in this database: enable idem's `postgres` feature, e.g. `idem = { version = \"..\", features = [\"postgres\"] }`"
);
#[allow(unused_variables)]
pub fn place_all(
    store: impl ::core::marker::Sized,
    orders: &[Order],
) -> ::core::future::Pending<Result<::idem::__private::Batch<()>, AppError>> {
    let _: ::core::option::Option<&mut sqlx::Transaction<'_, Postgres>> = ::core::option::Option::None;
    ::core::future::pending()
}
