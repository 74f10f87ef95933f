// An `IdempotencyLayer` that was given no principal is not a tower `Layer`: the error says
// to choose one.
use axum::Router;
use idem::http::IdempotencyLayer;
use sqlx::Sqlite;

fn app(store: idem::Store<Sqlite>) -> Router {
    Router::new().layer(IdempotencyLayer::new(store, "invoices"))
}

fn main() {
    drop(app);
}
