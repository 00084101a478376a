"""Adapters to other people's code, each behind an optional extra.

- `app.integrations.datatrove` (`pip install 'inferproxy[datatrove]'`): a
  drop-in for datatrove's `InferenceRunner` that sends everything through a
  running `inferproxy serve`, and a one-call switch of datatrove's own runner
  to inferproxy's checkpointing library.

Nothing outside this package imports them: inferproxy's core never needs the
other project installed.
"""
