"""The prefill worker: an engine in the prefill role that pushes each prompt's KV to the decode
worker named in the request's ticket (`prefill_worker.prefill_core`)."""
