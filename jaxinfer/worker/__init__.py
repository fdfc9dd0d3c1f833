"""The device side: parameters and KV caches on the devices, the compiled step and its launch.

worker.py         Worker: the engine's one door (a plan in, a StepHandle out, tokens when they land)
device_state.py   DeviceState: the placed parameters and the KV caches, and their mesh
compiled_step.py  CompiledStep: the step's jitted variants, their warm-up and launch
step.py           the jitted step: forward + KV write + sample over a ragged batch
step_variants.py  which variants compile (buckets, penalties, greedy twin, prompt logprobs)
warm_up.py        compiling every variant at start-up; JAX's persistent compilation cache
launcher.py       launching steps from a thread of their own
inputs.py         a plan's numpy inputs, padded to its bucket
page_table.py     the device's page table, and the entries a plan changes
kv_pool.py        how many KV pages fit, and the zeroed caches
kv_calibration.py int8 / fp8 KV scales measured at start-up
host_memory.py    the CPU's heap kept for the next step's temporaries
page_copy.py      copy-on-write pages copied before the step that writes them
kv_host.py        the host tier's bytes: pages out to host memory and back (timed at start-up)
kv_transfer.py    KV pages pulled from another engine's pool (jax.experimental.transfer)
"""
