"""The wire contract between coordinator and devices: what travels over MQTT.

- :mod:`edge.wire.topics`: topic names under ``edgetrain/v1/`` and job-id rules;
- :mod:`edge.wire.messages`: control messages (JSON, validated by pydantic);
- :mod:`edge.wire.frames`: the binary tensor frame (header, codecs, checksum);
- :mod:`edge.wire.groups`: a stage run by a group: who holds which rows, who sends whom what;
- :mod:`edge.wire.timeline`: a step report's waits and sends, as the text it carries.

Nothing here unpickles or imports what it receives.
"""

__all__: list[str] = []
