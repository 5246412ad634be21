//! `BENCH_METRICS_RECORDER=1` installs a Prometheus recorder before any layer is built,
//! as a service exporting metrics would, so the cost of recording is measured; unset,
//! no recorder is installed (the `metrics` facade's handles do nothing).

/// Installs the recorder when the environment asks for it.
pub fn install_if_asked() {
    if std::env::var_os("BENCH_METRICS_RECORDER").is_some() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        metrics::set_global_recorder(recorder).expect("no recorder installed yet");
    }
}
