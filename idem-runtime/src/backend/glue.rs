//! The macros that write a backend's `impl Backend` from its folder: `own!` declares its
//! statement sets, `wiring!` the items that read its modules, `backend_fns!` the signatures of
//! the methods whose work sits in its concern files. Each is written here once rather than in
//! every backend.

/// Declares a backend's `Own`: the statement sets of its `claim`, `lease` and `outbox`
/// modules, and the extra fields its protocol needs (`field: Type = made_from(table)`),
/// made for a table by `Own::new`. Every backend's folder has those modules, so only the
/// extras differ.
macro_rules! own {
    ($db:ty $(, $(#[$meta:meta])* $field:ident: $ty:ty = $make:expr)* $(,)?) => {
        /// The backend's own statements (see each file).
        #[derive(Debug)]
        pub struct Own {
            claim: claim::Statements<$db>,
            lease: lease::Statements<$db>,
            outbox: outbox::Statements<$db>,
            $($(#[$meta])* $field: $ty,)*
        }

        impl Own {
            fn new(table: &$crate::backend::Table) -> Self {
                Own {
                    claim: claim::Statements::new(table),
                    lease: lease::Statements::new(table),
                    outbox: outbox::Statements::new(table),
                    $($field: $make(table),)*
                }
            }

            /// The texts of the statement sets, for `sql::check_backend`.
            #[cfg(test)]
            fn texts() -> ::std::vec::Vec<::std::vec::Vec<(&'static str, String, &'static [&'static str])>> {
                ::std::vec![
                    claim::Statements::<$db>::each(),
                    lease::Statements::<$db>::each(),
                    outbox::Statements::<$db>::each(),
                ]
            }
        }
    };
}
pub(crate) use own;

/// The items of a backend's `Backend` impl that read its folder: its name, its `Own`
/// (from `own!`), the texts of its `claim`, `lease`, `outbox` and `operators` modules, and
/// its schema (`DDL`, `ADDED`; whether its DDL says `IF NOT EXISTS` for indexes).
macro_rules! wiring {
    (name: $name:literal, if_not_exists: $if_not_exists:literal $(,)?) => {
        const BACKEND: &'static str = $name;

        type Own = Own;

        fn texts() -> $crate::backend::Texts {
            $crate::backend::Texts {
                claim: claim::text(),
                lease: lease::text(),
                steps: lease::steps(),
                outbox: outbox::text(),
                offsets: operators::offsets(),
                ops: operators::text(),
                health: operators::health(),
            }
        }

        fn own(table: &$crate::backend::Table) -> Own {
            Own::new(table)
        }

        fn schema() -> $crate::backend::Schema {
            $crate::backend::Schema {
                ddl: DDL,
                added: ADDED,
                if_not_exists: $if_not_exists,
            }
        }
    };
}
pub(crate) use wiring;

/// Writes a backend's `Backend` methods from their arguments' patterns and a body: each
/// signature is written here once rather than once per backend. A backend lists the methods
/// whose work sits in its concern files, `name(patterns..) => body;`.
macro_rules! backend_fns {
    ($($(#[$meta:meta])* $name:ident($($arg:pat),* $(,)?) => $body:expr;)*) => {
        $(backend_fns!(@ $name ($($arg),*) $body);)*
    };
    (@ begin ($pool:pat, $sql:pat, $options:pat) $body:expr) => {
        backend_fns!(@fn begin<'p>([$pool] &'p ::sqlx::Pool<Self>, [$sql] &'p $crate::backend::Sql<Self>,
            [$options] &'p $crate::options::ClaimOptions) -> ::sqlx::Transaction<'static, Self>, $body);
    };
    (@ commit ($tx:pat, $check:pat, $options:pat) $body:expr) => {
        backend_fns!(@fn commit<'a>([$tx] ::sqlx::Transaction<'a, Self>, [$check] $crate::backend::Check<'a>,
            [$options] &'a $crate::options::ClaimOptions) -> bool, $body);
    };
    (@ claim_or_read ($conn:pat, $sql:pat, $c:pat, $replay:pat, $own:pat) $body:expr) => {
        backend_fns!(@fn claim_or_read<'t>([$conn] &'t mut Self::Connection, [$sql] &'t $crate::backend::Sql<Self>,
            [$c] $crate::backend::Claimant<'t>, [$replay] bool, [$own] bool) -> (bool, Option<$crate::backend::Found>), $body);
    };
    (@ lease_claim ($pool:pat, $sql:pat, $c:pat, $lease_ms:pat) $body:expr) => {
        backend_fns!(@fn lease_claim<'p>([$pool] &'p ::sqlx::Pool<Self>, [$sql] &'p $crate::backend::Sql<Self>,
            [$c] $crate::backend::Claimant<'p>, [$lease_ms] i64) -> $crate::backend::LeaseState, $body);
    };
    (@ outbox_take ($pool:pat, $sql:pat, $limit:pat, $lease_ms:pat, $sent:pat, $hold:pat)
        $body:expr) => {
        backend_fns!(@fn outbox_take<'p>([$pool] &'p ::sqlx::Pool<Self>, [$sql] &'p $crate::backend::Sql<Self>,
            [$limit] i64, [$lease_ms] i64, [$sent] &'p [&'p str], [$hold] &'p str) -> $crate::backend::Taken, $body);
    };
    (@ migrate ($pool:pat, $sql:pat) $body:expr) => {
        backend_fns!(@fn migrate<'p>([$pool] &'p ::sqlx::Pool<Self>, [$sql] &'p $crate::backend::Sql<Self>) -> (), $body);
    };
    (@ begin_primed ($pool:pat, $sql:pat) $body:expr) => {
        backend_fns!(@fn begin_primed<'p>([$pool] &'p ::sqlx::Pool<Self>, [$sql] &'p $crate::backend::Sql<Self>)
            -> (::sqlx::Transaction<'static, Self>, bool), $body);
    };
    (@ rollback ($tx:pat, $options:pat) $body:expr) => {
        backend_fns!(@fn rollback<'a>([$tx] ::sqlx::Transaction<'a, Self>, [$options] &'a $crate::options::ClaimOptions)
            -> (), $body);
    };
    (@ discard ($tx:pat, $options:pat) $body:expr) => {
        backend_fns!(@fn discard<'a>([$tx] ::sqlx::Transaction<'a, Self>, [$options] &'a $crate::options::ClaimOptions)
            -> (), $body);
    };
    (@ savepoint ($conn:pat, $step:pat) $body:expr) => {
        backend_fns!(@fn savepoint<'t>([$conn] &'t mut Self::Connection, [$step] $crate::backend::Savepoint)
            -> (), $body);
    };
    (@ take_over ($conn:pat, $sql:pat, $c:pat) $body:expr) => {
        backend_fns!(@fn take_over<'t>([$conn] &'t mut Self::Connection, [$sql] &'t $crate::backend::Sql<Self>,
            [$c] $crate::backend::Claimant<'t>) -> bool, $body);
    };
    (@ claim_batch ($conn:pat, $sql:pat, $c:pat, $keys:pat) $body:expr) => {
        backend_fns!(@fn claim_batch<'t>([$conn] &'t mut Self::Connection, [$sql] &'t $crate::backend::Sql<Self>,
            [$c] $crate::backend::Claimant<'t>, [$keys] &'t [&'t str]) -> Vec<String>, $body);
    };
    (@ take_over_batch ($conn:pat, $sql:pat, $c:pat, $keys:pat) $body:expr) => {
        backend_fns!(@fn take_over_batch<'t>([$conn] &'t mut Self::Connection,
            [$sql] &'t $crate::backend::Sql<Self>, [$c] $crate::backend::Claimant<'t>, [$keys] &'t [&'t str]) -> Vec<String>, $body);
    };
    (@ batch_markers ($conn:pat, $sql:pat, $scope:pat, $keys:pat) $body:expr) => {
        backend_fns!(@fn batch_markers<'t>([$conn] &'t mut Self::Connection,
            [$sql] &'t $crate::backend::Sql<Self>, [$scope] &'t str, [$keys] &'t [&'t str]) -> Vec<(String, $crate::backend::Found)>,
            $body);
    };
    (@ unclaim ($conn:pat, $sql:pat, $c:pat, $inserted:pat, $taken:pat) $body:expr) => {
        backend_fns!(@fn unclaim<'t>([$conn] &'t mut Self::Connection, [$sql] &'t $crate::backend::Sql<Self>,
            [$c] $crate::backend::Claimant<'t>, [$inserted] &'t [&'t str], [$taken] &'t [&'t str]) -> (), $body);
    };
    (@ batch_claimed ($conn:pat, $sql:pat, $options:pat) $body:expr) => {
        backend_fns!(@fn batch_claimed<'t>([$conn] &'t mut Self::Connection,
            [$sql] &'t $crate::backend::Sql<Self>, [$options] &'t $crate::options::ClaimOptions) -> (), $body);
    };
    (@ outbox_write ($conn:pat, $sql:pat, $outbox:pat, $fence:pat) $body:expr) => {
        backend_fns!(@fn outbox_write<'t>([$conn] &'t mut Self::Connection, [$sql] &'t $crate::backend::Sql<Self>,
            [$outbox] &'t $crate::outgoing::Unsent, [$fence] $crate::backend::Fence<'t>) -> (), $body);
    };
    (@ outbox_sent ($pool:pat, $sql:pat, $ids:pat, $hold:pat) $body:expr) => {
        backend_fns!(@fn outbox_sent<'p>([$pool] &'p ::sqlx::Pool<Self>, [$sql] &'p $crate::backend::Sql<Self>,
            [$ids] &'p [&'p str], [$hold] &'p str) -> u64, $body);
    };
    (@ outbox_release ($pool:pat, $sql:pat, $ids:pat, $hold:pat) $body:expr) => {
        backend_fns!(@fn outbox_release<'p>([$pool] &'p ::sqlx::Pool<Self>, [$sql] &'p $crate::backend::Sql<Self>,
            [$ids] &'p [&'p str], [$hold] &'p str) -> (), $body);
    };
    (@ listen ($pool:pat, $sql:pat) $body:expr) => {
        backend_fns!(@fn listen<'p>([$pool] &'p ::sqlx::Pool<Self>, [$sql] &'p $crate::backend::Sql<Self>)
            -> $crate::backend::Listen, $body);
    };
    (@fn $name:ident<$l:lifetime>($([$arg:pat] $ty:ty),*) -> $out:ty, $body:expr) => {
        fn $name<$l>($($arg: $ty),*)
            -> impl ::core::future::Future<Output = ::core::result::Result<$out, ::sqlx::Error>> + Send + $l {
            $body
        }
    };
}
pub(crate) use backend_fns;

/// Methods of [`Sql`](crate::backend::Sql) that run one statement of a set on `on` (a pool or
/// a connection) and read its answer, `=> f` for what is made of it: each is written as its
/// arguments and the statement it runs, the call around them here once.
macro_rules! sql_runs {
    ($(
        $(#[$meta:meta])*
        $name:ident($on:ident: $on_ty:ty $(, $arg:ident: $ty:ty)* $(,)?) -> $out:ty =
            $set:ident.$stmt:ident($($bind:expr),* $(,)?).$run:ident $(=> $then:expr)?;
    )*) => {
        impl<DB: $crate::backend::Backend> $crate::backend::Sql<DB> {
            $(
                $(#[$meta])*
                pub(crate) async fn $name(
                    &self,
                    $on: $on_ty,
                    $($arg: $ty),*
                ) -> ::core::result::Result<$out, ::sqlx::Error> {
                    let answer = self.$set.$stmt($($bind),*).$run($on).await;
                    answer$(.map($then))?
                }
            )*
        }
    };
}
pub(crate) use sql_runs;
