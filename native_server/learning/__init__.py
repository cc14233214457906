"""Learning from what the server sees (`ruvllm serve --witness-log DIR --learning`).

    witness.py         the witness log: requests and responses as JSON lines, rotated, bounded on disk
    witness_record.py  one request's witness line, filled in as it runs
    feedback.py        POST /v1/feedback: ratings and corrections for logged completions
    learner.py         the instant and background learning loops, adapters swapped into the engine
"""
