"""The part of every exported torch program that does not depend on the model (imports torch only).

`graphpar export --to torch` copies this file's text into `program.py` below the model's own
functions, so the program runs without graphpar; it is a module here so that it is linted and
read like any other. A rank's position on the mesh is its row-major coordinate; a collective
along mesh axes `axes` runs on the process group of the ranks that differ from this one only
along those axes (`torch.distributed.new_group` sorts ranks, which is the row-major order the
plan's group positions use). Placements are the plan's text: "S(d)", "R", "P", "P(max)".
"""

import argparse
import math
import os

import torch
import torch.distributed as dist

MESH_SHAPE: tuple = ()  # this rank's (sub-)mesh: its shape and global ranks, row-major
MESH_RANKS: tuple = ()
DEVICE = torch.device("cpu")
RANK = 0
COORD: tuple = ()  # this rank's coordinate on its mesh
GROUPS: dict = {}  # axes -> (process group, the group's global ranks in order)
PENDING: list = []  # sends in flight: waited for at the end of the step
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def coordinate(index, shape):
    coord = []
    for size in reversed(shape):
        coord.append(index % size)
        index //= size
    return tuple(reversed(coord))


def group_positions(coord, axes, shape):
    """The row-major positions on the mesh of the devices that differ from `coord` only along
    `axes`, in row-major order over those axes."""
    positions = []
    for index in range(math.prod(shape[a] for a in axes)):
        c = list(coord)
        for a in reversed(axes):
            c[a] = index % shape[a]
            index //= shape[a]
        position = 0
        for a, size in enumerate(shape):
            position = position * size + c[a]
        positions.append(position)
    return positions


def init(meshes, axes_used):
    """Join the job (torchrun's environment), pick the device and backend (NCCL on CUDA,
    gloo on CPU) and build one process group per mesh-axes group the program uses.

    `meshes`: every (sub-)mesh as (shape, global ranks); `axes_used[i]`: the axes mesh i's
    collectives run along. Every rank creates every group, in the same order (new_group is
    collective over the world), and keeps those of its own mesh."""
    global MESH_SHAPE, MESH_RANKS, DEVICE, RANK, COORD
    world = sum(math.prod(shape) for shape, _ in meshes)
    if torch.cuda.is_available():
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(DEVICE)
        dist.init_process_group("nccl", device_id=DEVICE)
    else:
        dist.init_process_group("gloo")
    RANK = dist.get_rank()
    if dist.get_world_size() != world:
        raise SystemExit(f"this program runs on {world} ranks, not {dist.get_world_size()}: "
                         f"torchrun --nproc-per-node {world}")
    for (shape, ranks), axes_list in zip(meshes, axes_used):
        mine = RANK in ranks
        if mine:
            MESH_SHAPE, MESH_RANKS = tuple(shape), tuple(ranks)
            COORD = coordinate(ranks.index(RANK), shape)
        for axes in axes_list:
            seen = set()
            for position in range(math.prod(shape)):
                members = tuple(ranks[p] for p in group_positions(
                    coordinate(position, shape), axes, shape))
                if members in seen:
                    continue
                seen.add(members)
                group = dist.new_group(list(members)) if len(members) > 1 else None
                if RANK in members:
                    GROUPS[tuple(axes)] = (group, members)


def _group(axes):
    return GROUPS[tuple(axes)]


def _position(axes):
    return _group(axes)[1].index(RANK)


# --- collectives along mesh axes ----------------------------------------------------------------

def all_reduce(x, axes, op):
    group, ranks = _group(axes)
    y = x.clone()
    dist.all_reduce(y, op=_OPS["sum" if op == "avg" else op], group=group)
    return y / len(ranks) if op == "avg" else y


def all_gather(x, axes, dim):
    group, ranks = _group(axes)
    # all_gather_single (torch 2.13's name for all_gather_into_tensor): concatenated on dim 0
    out = x.new_empty((len(ranks) * x.shape[0], *x.shape[1:]) if x.dim() else (len(ranks),))
    dist.all_gather_single(out, x.contiguous(), group=group)
    return torch.cat(out.chunk(len(ranks)), dim) if x.dim() else out


def reduce_scatter(x, axes, dim, op):
    group, ranks = _group(axes)
    # reduce_scatter_single (torch 2.13's name for reduce_scatter_tensor): my chunk of dim 0
    chunks = torch.cat(x.chunk(len(ranks), dim), 0).contiguous()
    out = x.new_empty(x.chunk(len(ranks), dim)[0].shape)
    dist.reduce_scatter_single(out, chunks, op=_OPS["sum" if op == "avg" else op], group=group)
    return out / len(ranks) if op == "avg" else out


def all_to_all(x, axes, split_dim, concat_dim):
    group, ranks = _group(axes)
    chunks = torch.cat(x.chunk(len(ranks), split_dim), 0).contiguous()
    out = torch.empty_like(chunks)
    dist.all_to_all_single(out, chunks, group=group)
    return torch.cat(out.chunk(len(ranks)), concat_dim)


def local_slice(x, axes, dim):
    """My chunk of `dim` (Replicate -> Shard): no communication."""
    n = len(_group(axes)[1])
    return x.chunk(n, dim)[_position(axes)].clone()


def local_zero(x, axes, op):
    """Replicate -> Partial(sum): the value at group position 0, zeros elsewhere."""
    return x.clone() if op != "sum" or _position(axes) == 0 else torch.zeros_like(x)


def local_pad(x, axes, dim):
    """Shard -> Partial(sum): my chunk in place in zeros n times larger along `dim`."""
    n = len(_group(axes)[1])
    shape = list(x.shape)
    shape[dim] *= n
    out = x.new_zeros(shape)
    out.narrow(dim, _position(axes) * x.shape[dim], x.shape[dim]).copy_(x)
    return out


def send(x, dst):
    payload = x.contiguous().clone()
    PENDING.append((dist.isend(payload, dst), payload))
    return x


def recv(src, shape, dtype):
    out = torch.empty(shape, dtype=dtype, device=DEVICE)
    dist.recv(out, src)
    return out


def send_tiles(x, src, dst, dim):
    """x cut into len(dst) tiles along `dim` (None: whole), tile j from src[j] to dst[j]."""
    tiles = x.chunk(len(dst), dim) if dim is not None else [x] * len(dst)
    for j, (s, d) in enumerate(zip(src, dst)):
        if s == RANK:
            send(tiles[j], d)
    return x


def recv_tile(src, dst, shape, dtype):
    return recv(src[list(dst).index(RANK)], shape, dtype)


def finish_sends():
    for work, _ in PENDING:
        work.wait()
    PENDING.clear()


# --- full tensors in, full tensors out ----------------------------------------------------------

def _shard_dims(placements):
    """{dim: [mesh axes sharding it, major first]}."""
    dims = {}
    for axis, p in enumerate(placements):
        if p.startswith("S("):
            dims.setdefault(int(p[2:-1]), []).append(axis)
    return dims


def shard(t, placements, coord=None):
    """The local tensor this rank holds of full tensor `t` laid out as `placements`."""
    coord = COORD if coord is None else coord
    for dim, axes in _shard_dims(placements).items():
        index, count = 0, 1
        for a in axes:
            index, count = index * MESH_SHAPE[a] + coord[a], count * MESH_SHAPE[a]
        size = t.shape[dim] // count
        t = t.narrow(dim, index * size, size)
    zero = any(p == "P" and coord[a] != 0 for a, p in enumerate(placements))
    return torch.zeros_like(t) if zero else t.clone()


def unshard(local, placements):
    """The full tensor from the local ones of every rank of this rank's mesh (a collective:
    each of them calls it)."""
    for axis, p in enumerate(placements):
        if p.startswith("P"):
            local = all_reduce(local, (axis,), p[2:-1] if "(" in p else "sum")
    dims = _shard_dims(placements)
    if not dims:
        return local
    every = tuple(range(len(MESH_SHAPE)))
    parts = all_gather(local.unsqueeze(0), every, 0)  # mesh positions in row-major order
    shape = [s * math.prod(MESH_SHAPE[a] for a in dims.get(d, [])) for d, s in
             enumerate(local.shape)]
    full = local.new_empty(shape)
    for position, part in enumerate(parts):
        coord = coordinate(position, MESH_SHAPE)
        view = full
        for dim, axes in dims.items():
            index = 0
            for a in axes:
                index = index * MESH_SHAPE[a] + coord[a]
            view = view.narrow(dim, index * local.shape[dim], local.shape[dim])
        view.copy_(part)
    return full


def save_atomically(obj, path):
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def command_line(description):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--inputs", required=True,
                        help='torch.save({"inputs": [...], "targets": [...]}) of full tensors')
    parser.add_argument("--outputs", required=True, help="where rank 0 writes the results")
    parser.add_argument("--weights", default=os.path.join(os.path.dirname(
        os.path.abspath(__file__)), "weights.pt"), help="the state the step starts from")
    return parser.parse_args()
