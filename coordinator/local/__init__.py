"""Real parts started on this machine: a broker and a fleet of agent processes.

- :mod:`coordinator.local.broker`: Mosquitto when present, else an embedded amqtt broker;
- :mod:`coordinator.local.fleet`: agent processes (catalogue devices, throttled) for
  ``edgetrain train``, the demo and tests.
"""

__all__: list[str] = []
