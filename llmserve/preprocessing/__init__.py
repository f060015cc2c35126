"""The steps that turn a request's prompt into validated token ids: tokenizer, chat template,
validation, tail tokenizer, batch encoder, and the Preprocessor that runs them in order.

A library below the services: the preprocess service runs them on its tokenizer threads, in
micro-batches, with its prompt cache; the gateway runs them itself for a small prompt at light
load (llmserve.gateway.local_preprocess), with the limits the preprocess tier reports, so both
answer alike.
"""
