"""The job client (`ProxyJob`) and the loop that runs a job through a proxy (`run_job`)."""
