"""Real parts started on this machine: a broker and a fleet of agent processes.

- :mod:`coordinator.local.broker`: Mosquitto when present, else an embedded amqtt broker;
- :mod:`coordinator.local.fleet`: agent processes (catalogue devices, throttled) for
  ``edgetrain train``, the demo and tests;
- :mod:`coordinator.local.demo`: the demo's coordinator, its fleet enrolled through the
  API and its jobs on data that stays home (what ``edgetrain demo`` runs);
- :mod:`coordinator.local.options`: a job and how it trains here, checked together
  (what ``edgetrain train`` asks for); :mod:`coordinator.local.choices`, its fixed
  choices as types, torch-free;
- :mod:`coordinator.local.train`: a job trained on this machine, as threads, ranks
  or a local fleet driven by the job engine (what ``edgetrain train`` runs).
"""

__all__: list[str] = []
