"""The simulated cluster (``run.mode = "sim"``): the production control-plane cores — request
queue, tensor store bookkeeping, controller, node group scheduler and weights holders, exploration
planner, trace replay and fault injector, cost meter — driven by a discrete-event loop on a virtual
clock, with workers timed by a model instead of computing (DESIGN.md §7, the ``sim`` backend).

- ``clock.py``: the virtual clock and its event loop;
- ``timing.py``: seconds per step / update / weight load / node start, per model profile and GPU;
- ``cores.py``: the processors work runs on (a device each, or cores shared by their processes);
- ``calibrate.py``: the tiny profile's primitives measured on this machine (``sim.calibration``);
- ``config.py``: the recipe's ``[sim]`` section;
- ``cluster.py``: the cores, the store's link, the injector's target;
- ``node.py``: a simulated node (the agent's shell around the group scheduler and weights holders);
- ``host.py``: a node whose GPUs come and go by spot instance (``sim.gpus_per_instance``: GPU-level
  preemption of SP groups);
- ``run.py``: the iteration driver (``SimRun``, ``simulate``).

Every figure it produces is labelled ``sim``; it never stands in for a test of the math.
"""
