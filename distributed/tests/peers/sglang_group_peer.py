"""One SGLang worker's side of the distributed weight update, with SGLang's own code (sglang
0.5.23): the request bodies parsed by `InitWeightsUpdateGroupReqInput` and
`UpdateWeightsFromDistributedReqInput`, the group formed as `WeightUpdater.init_weights_update_group`
forms it (`init_custom_process_group` over `NetworkAddress(...).to_tcp()`, rank = rank_offset +
tp_rank), and the tensors received as `receive_weights_from_distributed` receives them (one
`torch.distributed.broadcast(src=0)` each, in order). On CPU tensors, so the group must be Gloo.

    python sglang_group_peer.py '<init body JSON>' '<update body JSON>' <tp rank>

Prints one JSON line: each tensor's name, dtype, shape and values (as float64).
"""

import json
import sys

import torch
from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput
from sglang.srt.utils.common import init_custom_process_group
from sglang.srt.utils.network import NetworkAddress

init = InitWeightsUpdateGroupReqInput(**json.loads(sys.argv[1]))
update = UpdateWeightsFromDistributedReqInput(**json.loads(sys.argv[2]))
group = init_custom_process_group(
    backend=init.backend,
    init_method=NetworkAddress(init.master_address, init.master_port).to_tcp(),
    world_size=init.world_size,
    rank=init.rank_offset + int(sys.argv[3]),
    group_name=init.group_name,
)
weights, handles = [], []
for name, dtype, shape in zip(update.names, update.dtypes, update.shapes):
    weight = torch.empty(shape, dtype=getattr(torch, dtype))
    handles.append(torch.distributed.broadcast(weight, src=0, group=group, async_op=True))
    weights.append((name, weight))
for handle in handles:
    handle.wait()
print(
    json.dumps(
        [
            {"name": n, "dtype": str(w.dtype), "shape": list(w.shape), "values": w.double().flatten().tolist()}
            for n, w in weights
        ]
    ),
    flush=True,
)
