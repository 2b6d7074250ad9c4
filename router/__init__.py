"""The router: Tandem's front door (gRPC public API, OpenAI HTTP API, admin API). It tokenizes,
validates, admits, picks a prefill and a decode worker, relays the token stream, and cancels
both workers when the client goes away."""
