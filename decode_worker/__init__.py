"""The decode worker: an engine in the decode role that receives each prompt's KV from a prefill
worker and generates the rest (`decode_worker.decode_core`)."""
