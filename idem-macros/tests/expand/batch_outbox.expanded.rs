// if_postgres: the handler when the database's feature is on
pub async fn place_all(
    store: &::idem::__private::Store<Postgres>,
    orders: &[Order],
) -> Result<::idem::__private::Batch<()>, AppError> {
    static __IDEM_SPEC: ::idem::__private::Spec = ::idem::__private::Spec::new(
        "orders.place",
        "place_all",
        ::idem::__private::ClaimOptions::new(),
    );
    let __idem_keys = ::idem::__private::batch_keys(
        ::core::iter::Iterator::map(
            ::core::iter::IntoIterator::into_iter(orders),
            |order| ::idem::__private::Key::new(&(order.id)),
        ),
    );
    let __idem_jobs = <[_]>::len(orders);
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
        let __idem_fresh = ::idem::__private::fresh_jobs(orders, &__idem_claim);
        let (__idem_body_of, __idem_tx, __idem_outbox_ref) = ::idem::__private::batch_open(
            &mut __idem_claim,
        );
        let __idem_result: Result<(), AppError> = ::idem::__private::Body::run(
                __idem_body_of,
                async move {
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
pub fn place_all(
    store: impl ::core::marker::Sized,
    orders: &[Order],
) -> ::core::future::Pending<Result<::idem::__private::Batch<()>, AppError>> {
    let _: ::core::option::Option<&mut sqlx::Transaction<'_, Postgres>> = ::core::option::Option::None;
    ::core::future::pending()
}
