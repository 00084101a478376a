"""Commands built on the layers below: status, inspect, demo, the fake upstream."""
