"""Operating a proxy: metrics, logs, memory tuning."""
