"""The job side: `client.ProxyJob`, the checkpoint routes of one rank, and `run.run_job`, the loop on it."""
