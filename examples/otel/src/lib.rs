//! idem seen through OpenTelemetry: its tests (`tests/semconv.rs`) run handlers, hand-written
//! claims and the HTTP layer under a real OpenTelemetry SDK pipeline (tracing-opentelemetry
//! for the spans, metrics-exporter-otel for the `metrics` facade), exporting in memory, and
//! check the semantic conventions' names an OpenTelemetry collector's dashboards look for.
