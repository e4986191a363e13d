"""Types shared across layers: messages and their serializer, batch metadata, sampling
parameters, token logprobs, typed errors, and the ZMQ plumbing. Imports only `radixrt.config`."""
