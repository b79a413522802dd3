"""Support code for the tests, one module per kind of help (import from the module itself):

- `stack`: a router in front of simulated engines, in-process or as `narwhal serve`, and the
  requests the tests send it;
- `fake_engine`: a scripted engine for each leg, written by hand to the byte;
- `kube_api`: a Kubernetes API server for the pods part of core/v1;
- `load`: steady load from clients while a fleet changes;
- `workers`: a router of several worker processes;
- `real`: a real router in front of real vLLM engines on the CPU (tests/real);
- `fidelity`: the cases the simulator is held to, and the recorder of real vLLM's answers
  (`make record-vllm` runs it as a script);
- `tenants`: a router with `[[tenants]]`, its admission reachable as observers see it.
"""
