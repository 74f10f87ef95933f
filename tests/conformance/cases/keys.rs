//! Keys of the user's own types, through the attribute: a custom `IntoKey` that writes two
//! top-level parts, and a tuple of fields.

use idem::{IntoKey, KeyWriter};
use sqlx::Transaction;

use crate::conformance::Support;
use crate::conformance::ctx::Ctx;
use crate::conformance::db::{Bind, TestDb};
use crate::conformance::handlers::*;

/// A tenant's job number: two parts, the tenant's name and the number.
#[derive(Clone, Debug)]
pub(crate) struct TenantKey {
    pub(crate) tenant: String,
    pub(crate) n: u32,
}

impl IntoKey for TenantKey {
    fn write_key(&self, key: &mut KeyWriter) {
        key.part(&self.tenant);
        key.display(self.n);
    }
}

/// A job keyed by a [`TenantKey`]; its effect row is `(id, n)`.
#[derive(Clone, Debug)]
pub(crate) struct TenantJob {
    pub(crate) key: TenantKey,
    pub(crate) id: i64,
    pub(crate) effects: String,
}

async fn insert_tenant_effect<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    effects: &str,
    id: i64,
    amount: i64,
    origin: &str,
) -> Result<(), sqlx::Error> {
    let sql = format!("INSERT INTO {effects} (id, amount, origin) VALUES ($1, $2, $3)");
    let binds = [
        Bind::I64(id),
        Bind::I64(amount),
        Bind::Str(origin.to_owned()),
    ];
    DB::execute(&mut **tx, &sql, &binds).await?;
    Ok(())
}

#[idem::idempotent(key = "job.key", scope = "tenant")]
async fn apply_tenant<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &TenantJob,
) -> Result<i64, TestError> {
    let amount = i64::from(job.key.n);
    insert_tenant_effect(tx, &job.effects, job.id, amount, "tenant").await?;
    Ok(amount)
}

/// Two custom keys whose parts run together the same way (`acme1` `7`, `acme` `17`: both
/// `acme17` if the parts were concatenated) are distinct keys: both apply, each once.
pub(crate) async fn custom_keys_with_two_parts_cannot_collide<S: Support>() {
    let ctx = Ctx::<S>::new("custkey", 2).await;
    let jobs = [("acme1", 7, 1), ("acme", 17, 2)].map(|(tenant, n, id)| TenantJob {
        key: TenantKey {
            tenant: tenant.to_owned(),
            n,
        },
        id,
        effects: ctx.effects.clone(),
    });
    for job in &jobs {
        let got = apply_tenant(&ctx.store, job).await;
        assert_eq!(applied(got), i64::from(job.key.n), "{job:?}");
    }
    for job in &jobs {
        duplicate(apply_tenant(&ctx.store, job).await);
    }
    assert_eq!(ctx.effects(1).await, 1);
    assert_eq!(ctx.effects(2).await, 1);
    assert_eq!(ctx.effects_total().await, 2);
    assert_eq!(ctx.markers().await, 2);
    // Two parts are stored as the tuple of those parts: length-prefixed, so they cannot run
    // into each other.
    assert_eq!(
        ctx.stored_keys().await,
        vec!["4:acme|2:17".to_owned(), "5:acme1|1:7".to_owned()]
    );
    ctx.cleanup().await;
}

/// A job with its tenant and number as plain fields.
#[derive(Clone, Debug)]
pub(crate) struct FieldsJob {
    pub(crate) tenant: String,
    pub(crate) n: u32,
    pub(crate) id: i64,
    pub(crate) effects: String,
}

// `key = "(job.tenant, job.n)"` does not compile: the macro evaluates `&((job.tenant, job.n))`,
// which moves the `String` out of `&FieldsJob` (E0507). Borrowing the field is the way today.
#[idem::idempotent(key = "(&job.tenant, job.n)", scope = "tenant")]
async fn apply_tuple_key<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &FieldsJob,
) -> Result<i64, TestError> {
    let amount = i64::from(job.n);
    insert_tenant_effect(tx, &job.effects, job.id, amount, "tuple").await?;
    Ok(amount)
}

/// The same two jobs keyed by the tuple `(&job.tenant, job.n)` of a borrowed `String` and an
/// integer field: distinct keys, each applied once, stored like the custom key's.
pub(crate) async fn tuple_keys_of_fields_cannot_collide<S: Support>() {
    let ctx = Ctx::<S>::new("tuplekey", 2).await;
    let jobs = [("acme1", 7, 1), ("acme", 17, 2)].map(|(tenant, n, id)| FieldsJob {
        tenant: tenant.to_owned(),
        n,
        id,
        effects: ctx.effects.clone(),
    });
    for job in &jobs {
        assert_eq!(
            applied(apply_tuple_key(&ctx.store, job).await),
            i64::from(job.n)
        );
    }
    for job in &jobs {
        duplicate(apply_tuple_key(&ctx.store, job).await);
    }
    assert_eq!(ctx.effects(1).await, 1);
    assert_eq!(ctx.effects(2).await, 1);
    assert_eq!(ctx.effects_total().await, 2);
    assert_eq!(ctx.markers().await, 2);
    assert_eq!(
        ctx.stored_keys().await,
        vec!["4:acme|2:17".to_owned(), "5:acme1|1:7".to_owned()]
    );
    ctx.cleanup().await;
}
