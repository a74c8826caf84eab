/* graphpar viz: lays out and draws the embedded IR graphs. No dependencies, no network.
 *
 * Data: the JSON of graphpar/viz/data.py in <script id="graphpar-data">.
 * Layout: every expanded module group is laid out on its own (layered: cycle breaking, longest
 * path layers, barycenter ordering, least-squares x placement) and then placed as one box in its
 * parent's layout, so clusters never overlap. An edge crosses cluster borders at ports and each
 * cluster routes its own part: through dummy points when it skips a layer or two, else in a
 * side lane. Drawing: one SVG string per render; colors and marks are CSS classes.
 */
(function () {
  "use strict";

  const DATA = JSON.parse(document.getElementById("graphpar-data").textContent);
  const ROLES = ["input", "param", "buffer", "optim_state", "const"];
  const ROLES_SHOWN = { input: true };  // the rest sit behind the header toggles
  const PHASES = ["forward", "backward", "optimizer"];
  const LAYOUT_PALETTE = ["#8ecae6", "#ffb703", "#90be6d", "#f28482", "#b8a1e3", "#f6bd60",
    "#84dcc6", "#e5989b", "#a3c4f3", "#c9e4a4", "#ffd6a5", "#bdb2ff", "#9bf6ff", "#d4a373"];
  const AUTO_EXPAND_BUDGET = 320;  // items drawn before the first click
  const GAP_X = 18, GAP_Y = 34, PAD = 12, HEAD = 26, LANE = 7, MAX_LANES = 40, WRAP = 12;
  const FONT_MONO = "ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', " +
    "'Liberation Mono', monospace";
  const FONT_UI = "system-ui, -apple-system, 'Segoe UI', Roboto, 'DejaVu Sans', " +
    "'Liberation Sans', sans-serif";

  const $ = (id) => document.getElementById(id);
  const svg = $("graph");
  const css = getComputedStyle(document.documentElement);
  const kindColor = (k) => css.getPropertyValue("--k-" + k).trim() || "#fff";
  const phaseColor = (p) => css.getPropertyValue("--p-" + p).trim() || "#fff";
  const roleColor = (r) => css.getPropertyValue("--r-" + r).trim() || "#fff";
  // A stage's colour is its sub-mesh's (the pipeline data's); without one, the palette's.
  const STAGE_PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#e15759", "#76b7b2",
    "#edc948", "#ff9da7", "#9c755f", "#bab0ac"];
  const stageColor = (s) => {
    const band = DATA.pipeline && DATA.pipeline.stages.find((b) => b.stage === s);
    return band ? band.color : STAGE_PALETTE[s % STAGE_PALETTE.length];
  };
  const stageFill = (s) => stageColor(s) + "80";  // half opacity, so the text stays readable

  // ------------------------------------------------------------------ formatting

  function esc(s) {
    return String(s).replace(/[&<>"']/g, (c) =>
      ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }
  function fmtCount(n, unit) {  // as graphpar.ir.printer.format_count
    for (const [p, s] of [["T", 1e12], ["G", 1e9], ["M", 1e6], ["K", 1e3]]) {
      if (n >= s) return (n / s).toFixed(1) + " " + p + unit;
    }
    return Math.floor(n) + " " + unit;
  }
  function fmtBytes(n) {
    for (const [p, s] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]]) {
      if (n >= s) return (n / s).toFixed(1) + " " + p;
    }
    return n + " B";
  }
  const fmtInt = (n) => Number(n).toLocaleString("en-US");
  const clip = (s, n) => (s.length > n ? s.slice(0, n - 1) + "…" : s);

  const measureCtx = document.createElement("canvas").getContext("2d");
  const widthCache = new Map();
  function textWidth(text, font) {
    const key = font + "\u0000" + text;
    let w = widthCache.get(key);
    if (w === undefined) {
      measureCtx.font = font;
      w = measureCtx.measureText(text).width;
      widthCache.set(key, w);
    }
    return w;
  }
  const F_OP = "600 12px " + FONT_MONO, F_TY = "11px " + FONT_MONO;
  const F_LAY = "600 11px " + FONT_MONO, F_FL = "10px " + FONT_UI;
  const F_LABEL = "600 12px " + FONT_UI, F_STAT = "11px " + FONT_UI;

  // ------------------------------------------------------------------ the graph model

  function prepare(g) {
    const root = { id: null, key: "root", childGroups: [], nodes: [], inputs: [], anc: [] };
    const M = { g, root, nodes: g.nodes, inputs: g.inputs, groups: g.groups, edges: [] };
    for (const gr of g.groups) {
      Object.assign(gr, { key: "g" + gr.id, childGroups: [], nodes: [], inputs: [], total: 0,
        flops: 0, kinds: {}, first: Infinity, roles: {} });
      const parent = gr.parent === undefined ? root : g.groups[gr.parent];
      gr.anc = parent.anc.concat([gr.id]);
      // drawn inside its parent, a group needs only the rest of its path: "attn" in "blocks.0"
      const prefix = parent.module ? parent.module + "." : "";
      gr.short = prefix && gr.label.startsWith(prefix) ? gr.label.slice(prefix.length) : gr.label;
      parent.childGroups.push(gr);
    }
    const container = (el) => (el.group === undefined ? root : g.groups[el.group]);
    g.inputs.forEach((inp, i) => {
      inp.key = "i" + i;
      inp.users = [];
      inp.outputOf = [];  // graph outputs that are this input, or that update / differentiate it
    });
    for (const n of g.nodes) {
      n.key = "n" + n.id;
      n.users = [];
      n.outputRoles = [];
      n.layout = (n.outputs.find((o) => o.layout) || {}).layout;
      const c = container(n);
      c.nodes.push(n);
      for (const gid of c.anc) {
        const gr = g.groups[gid];
        gr.total += 1;
        gr.flops += n.flops;
        gr.kinds[n.kind] = (gr.kinds[n.kind] || 0) + 1;
        gr.first = Math.min(gr.first, n.id);
      }
      const seen = new Set();
      for (const op of n.inputs) {
        const src = op.node !== undefined ? "n" + op.node : op.input !== undefined ? "i" + op.input : null;
        if (src === null || seen.has(src)) continue;
        seen.add(src);
        (op.node !== undefined ? g.nodes[op.node] : g.inputs[op.input]).users.push(n.id);
        // forward values the backward pass reads: drawn only on request (they cross everything)
        const saved = op.node !== undefined && n.phase === "backward" &&
          g.nodes[op.node].phase === "forward";
        M.edges.push({ s: src, t: n.key, v: op.value, ty: op.type, saved });
      }
    }
    for (const inp of g.inputs) {
      const c = container(inp);
      c.inputs.push(inp);
      for (const gid of c.anc) {
        const r = g.groups[gid].roles;
        r[inp.role] = r[inp.role] || { count: 0, bytes: 0 };
        r[inp.role].count += 1;
        r[inp.role].bytes += inp.bytes;
      }
    }
    const byName = new Map(g.inputs.map((v) => [v.name, v]));
    for (const out of g.outputs) {
      const tag = out.target ? `${out.role}(%${out.target})` : out.role;
      if (out.node !== undefined) g.nodes[out.node].outputRoles.push(tag);
      else if (out.input !== undefined) g.inputs[out.input].outputOf.push({ tag, out });
      if (out.target && byName.has(out.target)) byName.get(out.target).outputOf.push({ tag, out });
    }
    M.layouts = Object.keys(g.summary.layouts || {});
    M.layoutColor = new Map(M.layouts.map((l, i) => [l, LAYOUT_PALETTE[i % LAYOUT_PALETTE.length]]));
    M.state = {
      expanded: new Set(),
      roles: Object.assign({}, ROLES_SHOWN),
      colorBy: Object.keys(g.summary.stages || {}).length ? "stage" :
        M.layouts.length ? "layout" : "kind",
      selected: null, view: null, query: "", matches: [], matchIndex: -1, saved: false,
    };
    M.savedCount = M.edges.filter((e) => e.saved).length;
    M.state.expanded = autoExpand(M);
    return M;
  }

  const containerOf = (M, el) => (el.group === undefined ? M.root : M.groups[el.group]);
  const shownInputs = (M, c) => c.inputs.filter((v) => M.state.roles[v.role]).length;

  function element(M, key) {
    const id = Number(key.slice(1));
    return key[0] === "n" ? M.nodes[id] : key[0] === "i" ? M.inputs[id] : M.groups[id];
  }

  function autoExpand(M) {
    const expanded = new Set();
    let visible = M.root.childGroups.length + M.root.nodes.length + shownInputs(M, M.root);
    let frontier = M.root.childGroups.slice();
    while (frontier.length) {
      let delta = 0;
      for (const gr of frontier) {
        delta += gr.childGroups.length + gr.nodes.length + shownInputs(M, gr) - 1;
      }
      if (visible + delta > AUTO_EXPAND_BUDGET) break;
      visible += delta;
      for (const gr of frontier) expanded.add(gr.id);
      frontier = frontier.flatMap((gr) => gr.childGroups);
    }
    return expanded;
  }

  // The item an element is drawn as: itself, or its outermost collapsed group; null if hidden.
  function visibleOf(M, key) {
    const el = element(M, key);
    if (key[0] === "i" && !M.state.roles[el.role]) return null;
    for (const gid of containerOf(M, el).anc) {
      if (!M.state.expanded.has(gid)) return "g" + gid;
    }
    return key;
  }

  function pathOf(M, key) {  // the groups around a drawn item, then the item
    const el = element(M, key);
    const anc = key[0] === "g" ? (el.parent === undefined ? [] : M.groups[el.parent].anc) :
      containerOf(M, el).anc;
    return anc.map((id) => "g" + id).concat([key]);
  }

  // ------------------------------------------------------------------ layout

  function layoutAll(M) {
    const visEdges = new Map();
    for (const e of M.edges) {
      if (e.saved && !M.state.saved) continue;
      const a = visibleOf(M, e.s), b = visibleOf(M, e.t);
      if (!a || !b || a === b) continue;
      const k = a + ">" + b;
      let ve = visEdges.get(k);
      if (!ve) visEdges.set(k, ve = { a, b, values: [], count: 0 });
      ve.count += 1;  // values carried: the tooltip names the first few
      if (ve.values.length < 5) ve.values.push(e.v + ": " + e.ty);
    }
    // An edge is cut into segments, one per cluster it crosses: it leaves each cluster around
    // its source through an out-port on the bottom border and enters each cluster around its
    // target through an in-port on the top border. Edges between the same two items of the
    // cluster where they meet share their ports. Each cluster lays out its own segments, so
    // nothing is drawn across a cluster's content.
    const reps = new Map();  // cluster key -> Map("from>to" -> edge between its items)
    const ports = new Map();  // cluster key -> Set of port keys ("in:g3:n12", "out:g3:n12")
    const segment = (cluster, from, fromPort, to, toPort) => {
      let bucket = reps.get(cluster);
      if (!bucket) reps.set(cluster, bucket = new Map());
      const k = from + ">" + to;
      let rep = bucket.get(k);
      if (!rep) bucket.set(k, rep = { a: from, b: to, count: 0 });
      rep.count += 1;
      for (const port of [from, to]) {
        if (port.includes(":")) {
          if (!ports.has(cluster)) ports.set(cluster, new Set());
          ports.get(cluster).add(port);
        }
      }
      return { cluster, from, fromPort, to, toPort, rep };
    };
    for (const ve of visEdges.values()) {
      const pa = pathOf(M, ve.a), pb = pathOf(M, ve.b);
      let p = 0;
      while (p < pa.length && p < pb.length && pa[p] === pb[p]) p++;
      if (p >= pa.length || p >= pb.length) continue;
      const segs = [];
      let cur = ve.a, curPort = null;
      for (let k = pa.length - 2; k >= p; k--) {  // out of the clusters around the source
        const port = "out:" + pa[k] + ":" + pb[p];
        segs.push(segment(pa[k], cur, curPort, port, null));
        cur = pa[k];
        curPort = port;
      }
      const into = pb.slice(p, pb.length - 1);  // the clusters around the target, outermost first
      const inPort = (k) => "in:" + into[k] + ":" + pa[p];
      segs.push(segment(p === 0 ? "root" : pa[p - 1], cur, curPort,
        into.length ? into[0] : ve.b, into.length ? inPort(0) : null));
      for (let k = 0; k < into.length; k++) {
        const last = k + 1 === into.length;
        segs.push(segment(into[k], inPort(k), null, last ? ve.b : into[k + 1],
          last ? null : inPort(k + 1)));
      }
      ve.segs = segs;
    }
    const root = layoutCluster(M, M.root, reps, ports);
    return { root, visEdges };
  }

  function nodeItem(M, n) {
    const flops = n.flops ? fmtCount(n.flops, "FLOP") : "";
    const type = clip(n.outputs.map((o) => o.type).join(", ") || "()", 46);
    const layout = n.layout ? clip(n.outputs.map((o) => o.layout || "-").join(" "), 46) : "";
    // graph outputs: the role on the node ("loss", "grad"), the target in the details
    const badge = [...new Set(n.outputRoles.map((r) => r.split("(")[0]))].join(", ");
    let w = Math.max(textWidth(n.op, F_OP) + (flops ? textWidth(flops, F_FL) + 14 : 0),
      textWidth(type, F_TY), layout ? textWidth(layout, F_LAY) : 0) + 18;
    w = Math.max(64, Math.ceil(w));
    return { key: n.key, type: "node", el: n, w, h: layout ? 50 : 37, order: n.id,
      text: { flops, type, layout, badge } };
  }

  function inputItem(M, v) {
    const name = clip("%" + v.name, 48);
    const type = v.type + (v.layout ? " " + v.layout : "");
    const w = Math.ceil(Math.max(textWidth(name, "600 " + F_TY), textWidth(type, F_TY)) + 22);
    const order = v.users.length ? Math.min(...v.users) - 0.5 : -1;
    return { key: v.key, type: "input", el: v, w: Math.max(60, w), h: 35, order,
      text: { name, type } };
  }

  function groupStat(gr) {
    return gr.total + (gr.total === 1 ? " node" : " nodes") +
      (gr.flops ? " · " + fmtCount(gr.flops, "FLOP") : "");
  }

  function boxItem(M, gr) {
    const stat = groupStat(gr);
    const w = Math.ceil(Math.max(textWidth(gr.short, F_LABEL) + 34, textWidth(stat, F_STAT) + 20,
      150));
    return { key: gr.key, type: "box", el: gr, w, h: 54, order: gr.first, text: { stat } };
  }

  function layoutCluster(M, c, reps, ports) {
    const items = [];
    for (const cg of c.childGroups) {
      items.push(M.state.expanded.has(cg.id) ? layoutCluster(M, cg, reps, ports) : boxItem(M, cg));
    }
    for (const n of c.nodes) items.push(nodeItem(M, n));
    for (const v of c.inputs) if (M.state.roles[v.role]) items.push(inputItem(M, v));
    for (const key of ports.get(c.key) || []) {
      const port = key.slice(0, key.indexOf(":"));
      items.push({ key, type: "port", port, w: 4, h: 0, order: port === "in" ? -2 : Infinity });
    }
    items.sort((a, b) => a.order - b.order);
    const bucket = reps.get(c.key);
    const res = layered(items, bucket ? [...bucket.values()] : []);
    if (c === M.root) return Object.assign(res, { key: "root", type: "root", items });
    const stat = groupStat(c);
    const headW = textWidth(c.short, F_LABEL) + textWidth(stat, F_STAT) + 48;
    return { key: c.key, type: "cluster", el: c, items, order: c.first, lanesW: res.w,
      w: Math.ceil(Math.max(res.w + 2 * PAD, headW)), h: Math.ceil(res.h + HEAD + PAD),
      text: { stat } };
  }

  // Layered layout of one cluster's items: sets item.x/.y, and on each edge between them either
  // rep.via (points through skipped layers) or rep.lane (a side lane); returns the size.
  function layered(items, reps) {
    const n = items.length;
    if (!n) return { w: 0, h: 0 };
    const index = new Map(items.map((it, i) => [it.key, i]));
    const adj = items.map(() => []);
    const edges = [];
    for (const r of reps) {
      const u = index.get(r.a), v = index.get(r.b);
      r.via = r.lane = undefined;
      if (u === undefined || v === undefined || u === v) continue;
      const e = { u, v, r, rev: false };
      edges.push(e);
      adj[u].push(e);
    }
    // 1. cycles (possible between groups): reverse the back edges of a DFS in program order
    const mark = new Uint8Array(n);
    for (let s = 0; s < n; s++) {
      if (mark[s]) continue;
      const stack = [[s, 0]];
      mark[s] = 1;
      while (stack.length) {
        const top = stack[stack.length - 1];
        if (top[1] < adj[top[0]].length) {
          const e = adj[top[0]][top[1]++];
          if (mark[e.v] === 1) e.rev = true;
          else if (mark[e.v] === 0) { mark[e.v] = 1; stack.push([e.v, 0]); }
        } else {
          mark[top[0]] = 2;
          stack.pop();
        }
      }
    }
    for (const e of edges) { e.a = e.rev ? e.v : e.u; e.b = e.rev ? e.u : e.v; e.r.back = e.rev; }
    const succ = items.map(() => []), pred = items.map(() => []);
    for (const e of edges) { succ[e.a].push(e.b); pred[e.b].push(e.a); }
    const isPort = items.map((it) => Boolean(it.port));
    const W = items.map((it) => it.w), H = items.map((it) => it.h);

    // 2. layers: longest path from the sources, then sources moved down to their first use;
    // ports take no part (they get rows of their own)
    const layer = new Array(n).fill(0), indeg = pred.map((p) => p.length), topo = [];
    for (let i = 0; i < n; i++) if (!indeg[i]) topo.push(i);
    for (let q = 0; q < topo.length; q++) {
      const x = topo[q];
      for (const y of succ[x]) {
        if (!isPort[x] && !isPort[y] && layer[x] + 1 > layer[y]) layer[y] = layer[x] + 1;
        if (--indeg[y] === 0) topo.push(y);
      }
    }
    for (let i = 0; i < n; i++) {
      if (isPort[i] || pred[i].some((j) => !isPort[j])) continue;
      let m = Infinity;
      for (const y of succ[i]) if (!isPort[y]) m = Math.min(m, layer[y]);
      if (m !== Infinity) layer[i] = m - 1;
    }
    // no empty layers (moving sources down can empty one)
    const used = [...new Set(layer.filter((l, i) => !isPort[i]))].sort((a, b) => a - b);
    const dense = new Map(used.map((l, k) => [l, k]));
    for (let i = 0; i < n; i++) if (!isPort[i]) layer[i] = dense.get(layer[i]);
    // in-ports in a row of their own at the top, out-ports at the bottom
    const hasIn = isPort.some((p, i) => p && items[i].port === "in") ? 1 : 0;
    let nl = used.length + hasIn;
    for (let i = 0; i < n; i++) if (!isPort[i]) layer[i] += hasIn;
    let hasOut = 0;
    for (let i = 0; i < n; i++) {
      if (items[i].port === "in") layer[i] = 0;
      else if (items[i].port === "out") { layer[i] = nl; hasOut = 1; }
    }
    nl += hasOut;
    // a wide row of sinks (say an optimizer's independent updates) wraps into a grid
    for (let k = 0; k < nl; k++) {
      const row = [];
      for (let i = 0; i < n; i++) if (layer[i] === k && !isPort[i]) row.push(i);
      if (row.length <= WRAP || row.some((i) => succ[i].some((j) => !isPort[j]))) continue;
      const per = Math.ceil(Math.sqrt(row.length) * 1.5), extra = Math.ceil(row.length / per) - 1;
      for (let i = 0; i < n; i++) if (layer[i] > k) layer[i] += extra;
      row.forEach((i, j) => { layer[i] = k + Math.floor(j / per); });
      nl += extra;
      k += extra;
    }

    // 3. edges that skip one or two layers pass through points placed like thin items; longer
    // ones (and edges that go back up) run in side lanes, step 7
    let total = n;
    for (const e of edges) {
      const span = layer[e.b] - layer[e.a];
      if (e.rev || span < 2 || span > 3) continue;
      e.via = [];
      let prev = e.a;
      for (let k = layer[e.a] + 1; k < layer[e.b]; k++) {
        const d = total++;
        layer.push(k); W.push(2); H.push(0); isPort.push(false);
        succ.push([]); pred.push([prev]);
        succ[prev] = succ[prev].map((j) => (j === (prev === e.a ? e.b : -1) ? d : j));
        if (prev !== e.a) succ[prev].push(d);
        e.via.push(d);
        prev = d;
      }
      succ[prev].push(e.b);
      pred[e.b] = pred[e.b].map((j) => (j === e.a ? prev : j));
    }
    const layers = Array.from({ length: nl }, () => []);
    for (let i = 0; i < total; i++) layers[layer[i]].push(i);  // items come in program order

    // 4. order within layers: barycenter sweeps. Ports follow their neighbours but do not move
    // them, or a chain of groups would drift towards the ports at the far end of its edges.
    const predL = pred.map((nb, i) => (isPort[i] ? nb : nb.filter((j) => !isPort[j])));
    const succL = succ.map((nb, i) => (isPort[i] ? nb : nb.filter((j) => !isPort[j])));
    const pos = new Float64Array(total), bary = new Float64Array(total);
    const renumber = (ids) => ids.forEach((id, k) => { pos[id] = k - (ids.length - 1) / 2; });
    layers.forEach(renumber);
    for (let it = 0; it < 6; it++) {
      const down = it % 2 === 0;
      for (let k = 0; k < nl; k++) {
        const ids = layers[down ? k : nl - 1 - k];
        if (ids.length < 2) continue;
        for (const id of ids) {
          const nb = down ? predL[id] : succL[id];
          let s = 0;
          for (const j of nb) s += pos[j];
          bary[id] = nb.length ? s / nb.length : pos[id];
        }
        ids.sort((a, b) => bary[a] - bary[b] || pos[a] - pos[b]);
        renumber(ids);
      }
    }

    // 5. x: each layer packed, then moved towards its neighbours (least squares, order kept)
    const cx = new Float64Array(total), want = new Float64Array(total);
    for (const ids of layers) {
      let x = -(ids.reduce((s, id) => s + W[id], 0) + GAP_X * (ids.length - 1)) / 2;
      for (const id of ids) { cx[id] = x + W[id] / 2; x += W[id] + GAP_X; }
    }
    for (let it = 0; it < 9; it++) {
      const down = it % 2 === 0, both = it === 8;
      for (let k = 0; k < nl; k++) {
        const ids = layers[down ? k : nl - 1 - k];
        for (const id of ids) {
          const nb = both ? predL[id].concat(succL[id]) : down ? predL[id] : succL[id];
          let s = 0;
          for (const j of nb) s += cx[j];
          want[id] = nb.length ? s / nb.length : cx[id];
        }
        placeRow(ids, W, want, cx);
      }
    }

    // 6. y: layers stacked (port rows close to the border), items centred in their layer
    const layerH = layers.map((ids) => Math.max(0, ...ids.map((id) => H[id])));
    const portRow = layers.map((ids) => ids.length > 0 && ids.every((id) => isPort[id]));
    const layerY = [];
    let y = 0;
    for (let k = 0; k < nl; k++) {
      layerY.push(y);
      y += layerH[k] + (portRow[k] || portRow[k + 1] ? 10 : GAP_Y);
    }
    const height = Math.max(0, y - (portRow[nl - 1] ? 10 : GAP_Y));
    let minX = Infinity;
    for (let i = 0; i < total; i++) minX = Math.min(minX, cx[i] - W[i] / 2);
    let width = 0;
    const layerRight = new Float64Array(nl);
    for (let i = 0; i < total; i++) {
      const right = cx[i] - minX + W[i] / 2;
      width = Math.max(width, right);
      layerRight[layer[i]] = Math.max(layerRight[layer[i]], right);
      if (i < n) {
        items[i].x = cx[i] - W[i] / 2 - minX;
        items[i].y = layerY[layer[i]] + (layerH[layer[i]] - H[i]) / 2;
      }
    }
    for (const e of edges) {
      if (e.via) {
        e.r.via = e.via.map((d) => [cx[d] - minX, layerY[layer[d]], layerY[layer[d]] + layerH[layer[d]]]);
      }
    }

    // 7. lanes, right of the layers they pass. Edges from one in-port or to one out-port share
    // a lane: a bus, not a fan of parallel lines.
    const buses = new Map();
    for (const e of edges) {
      if (e.via || (!e.rev && layer[e.b] - layer[e.a] < 2)) continue;
      const lo = layer[e.a] < layer[e.b] ? layer[e.a] : layer[e.b], hi = Math.max(layer[e.a], layer[e.b]);
      const key = isPort[e.u] ? "p" + e.u : isPort[e.v] ? "p" + e.v : "e" + buses.size;
      const bus = buses.get(key);
      if (bus) { bus.lo = Math.min(bus.lo, lo); bus.hi = Math.max(bus.hi, hi); bus.edges.push(e); }
      else buses.set(key, { lo, hi, edges: [e] });
    }
    const lanes = [];
    let right = width;
    for (const bus of [...buses.values()].sort((a, b) => (a.hi - a.lo) - (b.hi - b.lo))) {
      const { lo, hi } = bus;
      let base = 0;
      if (hi - lo > 1) for (let k = lo + 1; k < hi; k++) base = Math.max(base, layerRight[k]);
      else base = Math.max(layerRight[lo], layerRight[hi]);
      let x = base + 14;
      const near = lanes.filter((l) => l.lo < hi && lo < l.hi);
      for (let tries = 0; tries < MAX_LANES && near.some((l) => Math.abs(l.x - x) < LANE); tries++) {
        x += LANE;
      }
      lanes.push({ lo, hi, x });
      for (const e of bus.edges) e.r.lane = x;
      right = Math.max(right, x + 8);
    }
    return { w: right, h: height };
  }

  // Centres for one ordered row, as close as possible to `want` (pool adjacent violators).
  function placeRow(ids, w, want, cx) {
    const m = ids.length;
    const off = new Float64Array(m);
    for (let i = 1; i < m; i++) off[i] = off[i - 1] + (w[ids[i - 1]] + w[ids[i]]) / 2 + GAP_X;
    const sum = [], cnt = [], start = [];
    for (let i = 0; i < m; i++) {
      sum.push(want[ids[i]] - off[i]); cnt.push(1); start.push(i);
      while (sum.length > 1) {
        const t = sum.length - 1;
        if (sum[t - 1] / cnt[t - 1] <= sum[t] / cnt[t]) break;
        sum[t - 1] += sum[t]; cnt[t - 1] += cnt[t];
        sum.pop(); cnt.pop(); start.pop();
      }
    }
    for (let b = 0; b < sum.length; b++) {
      const end = b + 1 < start.length ? start[b + 1] : m;
      for (let i = start[b]; i < end; i++) cx[ids[i]] = sum[b] / cnt[b] + off[i];
    }
  }

  // ------------------------------------------------------------------ drawing

  let M = null;  // the graph on screen
  let drawn = null;  // { items: Map key -> item with absolute ax, ay; dom: Map key -> element }
  const models = DATA.graphs.map(() => null);
  let current = 0;

  function fillFor(it) {
    const by = M.state.colorBy;
    if (it.type === "node") {
      if (by === "layout") return it.el.layout ? M.layoutColor.get(it.el.layout) : "#ffffff";
      if (by === "phase" && it.el.phase) return phaseColor(it.el.phase);
      if (by === "stage" && it.el.stage !== undefined) return stageFill(it.el.stage);
    }
    return null;
  }

  function kindBar(kinds, x, y, width) {
    const total = Object.values(kinds).reduce((a, b) => a + b, 0) || 1;
    let out = "", at = x;
    for (const [k, c] of Object.entries(kinds).sort((a, b) => b[1] - a[1])) {
      const wk = width * c / total;
      out += `<rect x="${at.toFixed(1)}" y="${y}" width="${wk.toFixed(1)}" height="6" ` +
        `fill="${kindColor(k)}"><title>${esc(k)}: ${c}</title></rect>`;
      at += wk;
    }
    return out;
  }

  const triangle = (open) => open ? '<path d="M9 9 l9 0 l-4.5 7z" fill="#55607a"/>' :
    '<path d="M10 8 l7 4.5 l-7 4.5z" fill="#55607a"/>';

  function itemSvg(it) {
    const t = `transform="translate(${it.ax.toFixed(1)},${it.ay.toFixed(1)})"`;
    const el = it.el;
    if (it.type === "node") {
      const fill = fillFor(it);
      const cls = ["node", "k-" + el.kind];
      if (el.kind === "collective") cls.push("collective");
      if (el.outputRoles.length) cls.push("graph-output");
      if (el.phase) cls.push("ph-" + el.phase);
      let s = `<g class="${cls.join(" ")}" data-key="${it.key}" ${t}>` +
        `<rect class="body" width="${it.w}" height="${it.h}" rx="5"` +
        (fill ? ` style="fill:${fill}"` : "") + "/>" +
        `<text class="op" x="9" y="15">${esc(el.op)}</text>`;
      if (it.text.flops) {
        s += `<text class="fl" x="${it.w - 7}" y="14" text-anchor="end">${it.text.flops}</text>`;
      }
      s += `<text class="ty" x="9" y="30">${esc(it.text.type)}</text>`;
      if (it.text.layout) s += `<text class="lay" x="9" y="44">${esc(it.text.layout)}</text>`;
      if (it.text.badge) {
        s += `<text class="badge" x="${it.w}" y="-4" text-anchor="end">→ ${esc(it.text.badge)}</text>`;
      }
      return s + "</g>";
    }
    if (it.type === "input") {
      return `<g class="input r-${el.role}" data-key="${it.key}" ${t}>` +
        `<rect class="body" width="${it.w}" height="${it.h}" rx="12"/>` +
        `<text class="name" x="11" y="14">${esc(it.text.name)}</text>` +
        `<text class="ty" x="11" y="28">${esc(it.text.type)}</text></g>`;
    }
    // a collapsed group
    const ph = el.phase ? " ph-" + el.phase : "";
    return `<g class="group-box${ph}" data-key="${it.key}" ${t}>` +
      `<rect class="body" width="${it.w}" height="${it.h}" rx="7"/>` + triangle(false) +
      `<text class="label" x="23" y="17">${esc(el.short)}</text>` +
      `<text class="stat" x="10" y="34">${esc(it.text.stat)}</text>` +
      kindBar(el.kinds, 10, 41, it.w - 20) + "</g>";
  }

  function clusterSvg(it) {
    const el = it.el;
    const ph = el.phase ? " ph-" + el.phase : "";
    const lw = textWidth(el.short, F_LABEL);
    return `<g class="cluster${ph}" data-key="${it.key}" ` +
      `transform="translate(${it.ax.toFixed(1)},${it.ay.toFixed(1)})">` +
      `<rect class="frame" width="${it.w}" height="${it.h}" rx="8"/>` +
      `<g class="head" data-key="${it.key}"><rect width="${it.w}" height="${HEAD - 4}" rx="8"/>` +
      triangle(true) + `<text class="label" x="23" y="16">${esc(el.short)}</text>` +
      `<text class="stat" x="${(lw + 33).toFixed(0)}" y="16">${esc(it.text.stat)}</text></g></g>`;
  }

  // Where a segment starts (bottom of its source) or ends (top of its target), in page units.
  function endPoint(items, key, port, isSource) {
    if (key.includes(":")) {  // a port of the cluster the segment runs in: on its border
      const P = items.get(key), C = items.get(key.split(":")[1]);
      return [P.ax + P.w / 2, key[0] === "i" ? C.ay : C.ay + C.h];
    }
    const I = items.get(key), P = port && items.get(port);
    return [P ? P.ax + P.w / 2 : I.ax + I.w / 2, isSource ? I.ay + I.h : I.ay];
  }

  function edgePath(ve, items, origins) {
    return ve.segs.map((s) => {
      const [sx, sy] = endPoint(items, s.from, s.fromPort, true);
      const [tx, ty] = endPoint(items, s.to, s.toPort, false);
      const o = origins.get(s.cluster);
      if (s.rep.via) return viaPath(sx, sy, tx, ty, s.rep.via, o);
      return segmentPath(sx, sy, tx, ty, s.rep.lane === undefined ? undefined : o.x + s.rep.lane);
    }).join("");
  }

  // Through the skipped layers: a vertical run at each point, curves in between.
  function viaPath(sx, sy, tx, ty, via, o) {
    let d = "", x = sx, y = sy;
    for (const [px, top, bottom] of via) {
      d += segmentPath(x, y, o.x + px, o.y + top) + `L${(o.x + px).toFixed(1)} ${(o.y + bottom).toFixed(1)}`;
      x = o.x + px;
      y = o.y + bottom;
    }
    return d + segmentPath(x, y, tx, ty);
  }

  function segmentPath(sx, sy, tx, ty, lx) {
    const f = (v) => v.toFixed(1);
    if (lx === undefined) {
      const dy = Math.max(Math.abs(ty - sy) / 2, 12);
      return `M${f(sx)} ${f(sy)}C${f(sx)} ${f(sy + dy)} ${f(tx)} ${f(ty - dy)} ${f(tx)} ${f(ty)}`;
    }
    if (ty > sy + 40) {
      return `M${f(sx)} ${f(sy)}C${f(sx)} ${f(sy + 24)} ${f(lx)} ${f(sy + 4)} ${f(lx)} ${f(sy + 28)}` +
        `L${f(lx)} ${f(ty - 28)}C${f(lx)} ${f(ty - 4)} ${f(tx)} ${f(ty - 24)} ${f(tx)} ${f(ty)}`;
    }
    return `M${f(sx)} ${f(sy)}C${f(sx)} ${f(sy + 26)} ${f(lx)} ${f(sy + 26)} ${f(lx)} ${f(sy)}` +
      `L${f(lx)} ${f(ty)}C${f(lx)} ${f(ty - 26)} ${f(tx)} ${f(ty - 26)} ${f(tx)} ${f(ty)}`;
  }

  function render() {
    const t0 = performance.now();
    const { root, visEdges } = layoutAll(M);
    const items = new Map(), origins = new Map([["root", { x: 0, y: 0 }]]);
    const clusters = [], nodes = [];
    (function place(c, ox, oy) {
      for (const it of c.items) {
        it.ax = ox + it.x;
        it.ay = oy + it.y;
        items.set(it.key, it);
        if (it.type === "cluster") {
          clusters.push(clusterSvg(it));
          origins.set(it.key, { x: it.ax + PAD, y: it.ay + HEAD });
          place(it, it.ax + PAD, it.ay + HEAD);
        } else if (it.type !== "port") {
          nodes.push(itemSvg(it));
        }
      }
    })(root, 0, 0);
    const edges = [];
    for (const ve of visEdges.values()) {
      if (!ve.segs) continue;
      const cls = "edge" + (ve.segs.some((s) => s.rep.back) ? " back" : "");
      const more = ve.count > ve.values.length ? `\n… ${ve.count} values` : "";
      const width = ve.count > 1 ? ` style="stroke-width:${(1.1 + Math.log2(ve.count) * 0.5).toFixed(2)}"` : "";
      edges.push(`<path class="${cls}" data-a="${ve.a}" data-b="${ve.b}"${width} ` +
        `d="${edgePath(ve, items, origins)}" marker-end="url(#arrow)">` +
        `<title>${esc(ve.values.join("\n") + more)}</title></path>`);
    }
    svg.innerHTML =
      '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" ' +
      'markerHeight="6" orient="auto-start-reverse"><path d="M0 1L10 5L0 9z" fill="#8a94a6"/>' +
      "</marker></defs>" +
      `<g id="viewport">${clusters.join("")}${edges.join("")}${nodes.join("")}</g>`;
    const dom = new Map();
    for (const el of svg.querySelectorAll(".node,.input,.group-box,.cluster")) {
      dom.set(el.getAttribute("data-key"), el);
    }
    const top = root.items.filter((it) => it.type !== "port").sort((a, b) => a.y - b.y || a.order - b.order)[0];
    drawn = { items, dom, w: root.w, h: root.h, ms: performance.now() - t0, first: top && top.key };
    $("empty").hidden = M.nodes.length > 0;
    applyView();
    applyMarks();
    svg.setAttribute("data-render-ms", drawn.ms.toFixed(1));
    svg.setAttribute("data-items", String(items.size));
  }

  // ------------------------------------------------------------------ view: pan, zoom, fit

  function applyView() {
    const v = M.state.view;
    const vp = $("viewport");
    if (vp && v) vp.setAttribute("transform", `translate(${v.x.toFixed(1)},${v.y.toFixed(1)}) scale(${v.k.toFixed(4)})`);
  }

  function fit(whole) {
    const W = svg.clientWidth || 1200, H = svg.clientHeight || 700, m = 24;
    const w = Math.max(drawn.w, 1), h = Math.max(drawn.h, 1);
    let k = Math.min(1, (W - 2 * m) / w, (H - 2 * m) / h);
    if (!whole && k < 0.7) {  // a big graph: readable scale, its first item at the top centre
      k = Math.max(0.8, Math.min(1, (W - 2 * m) / w));
      let x = (W - w * k) / 2;
      const first = drawn.first && drawn.items.get(drawn.first);
      if (w * k > W && first) x = W / 2 - (first.ax + first.w / 2) * k;
      M.state.view = { k, x, y: m };
    } else {
      M.state.view = { k, x: (W - w * k) / 2, y: Math.max(m, (H - h * k) / 2) };
    }
    applyView();
  }

  function zoomAt(factor, px, py) {
    const v = M.state.view;
    const k = Math.min(4, Math.max(0.02, v.k * factor));
    v.x = px - (px - v.x) * (k / v.k);
    v.y = py - (py - v.y) * (k / v.k);
    v.k = k;
    applyView();
  }

  function centerOn(key) {
    const it = drawn.items.get(key);
    if (!it) return;
    const v = M.state.view, W = svg.clientWidth, H = svg.clientHeight;
    const panel = $("details").hidden ? 0 : $("details").offsetWidth;
    if (v.k < 0.6) v.k = 0.8;
    v.x = (W - panel) / 2 - (it.ax + it.w / 2) * v.k;
    v.y = H / 2 - (it.ay + it.h / 2) * v.k;
    applyView();
  }

  // Re-layout keeping `key` (the group just toggled) where it was on screen.
  function relayoutAnchored(key) {
    const before = drawn && drawn.items.get(key);
    const v = M.state.view;
    const sx = before ? v.x + before.ax * v.k : 0, sy = before ? v.y + before.ay * v.k : 0;
    render();
    const after = drawn.items.get(key);
    if (before && after) {
      v.x = sx - after.ax * v.k;
      v.y = sy - after.ay * v.k;
      applyView();
    }
  }

  // ------------------------------------------------------------------ marks: selection, search

  function applyMarks() {
    const st = M.state;
    for (const el of svg.querySelectorAll(".sel,.match")) el.classList.remove("sel", "match");
    for (const el of svg.querySelectorAll("path.edge.hl,path.edge.hl-in")) el.classList.remove("hl", "hl-in");
    for (const el of svg.querySelectorAll("text.hits")) el.remove();
    svg.classList.toggle("searching", st.query.length > 0);
    if (st.query) {
      const boxHits = new Map();
      for (const key of st.matches) {
        const vis = visibleOf(M, key) || key;
        const el = drawn.dom.get(vis);
        if (!el) continue;
        el.classList.add("match");
        if (vis !== key) boxHits.set(vis, (boxHits.get(vis) || 0) + 1);
      }
      for (const [key, count] of boxHits) {
        const it = drawn.items.get(key);
        drawn.dom.get(key).insertAdjacentHTML("beforeend",
          `<text class="hits" x="${it.w - 8}" y="17" text-anchor="end">${count} match${count > 1 ? "es" : ""}</text>`);
      }
    }
    if (st.selected) {
      const vis = visibleOf(M, st.selected);
      const el = vis && drawn.dom.get(vis);
      if (el) {
        el.classList.add("sel");
        for (const p of svg.querySelectorAll(`path.edge[data-a="${vis}"]`)) p.classList.add("hl");
        for (const p of svg.querySelectorAll(`path.edge[data-b="${vis}"]`)) p.classList.add("hl-in");
      }
    }
  }

  function matchesOf(query) {
    const q = query.trim().toLowerCase();
    if (!q) return [];
    const [field, value] = q.includes(":") && /^(kind|phase|role|op|module|layout|stage):/.test(q) ?
      [q.slice(0, q.indexOf(":")), q.slice(q.indexOf(":") + 1).trim()] : [null, q];
    const has = (s) => s !== undefined && s !== null && String(s).toLowerCase().includes(value);
    const out = [];
    for (const n of M.nodes) {
      const hit = field === "kind" ? n.kind === value : field === "phase" ? n.phase === value :
        field === "stage" ? String(n.stage) === value :
        field === "op" ? n.op === value : field === "module" ? has(n.module) :
        field === "layout" ? n.outputs.some((o) => has(o.layout)) : field === "role" ? false :
        has(n.op) || has(n.module) || has(n.loc) || n.outputs.some((o) => o.name.toLowerCase() === value || o.name.toLowerCase() === "%" + value);
      if (hit) out.push(n.key);
    }
    for (const v of M.inputs) {
      const hit = field === "role" ? v.role === value : field === "layout" ? has(v.layout) :
        field === null ? has("%" + v.name) : false;
      if (hit) out.push(v.key);
    }
    return out;
  }

  function runSearch(query) {
    const st = M.state;
    st.query = query.trim();
    st.matches = matchesOf(st.query);
    st.matchIndex = -1;
    $("search-count").textContent = st.query ? `${st.matches.length} match${st.matches.length === 1 ? "" : "es"}` : "";
    applyMarks();
  }

  function nextMatch(step) {
    const st = M.state;
    if (!st.matches.length) return;
    st.matchIndex = (st.matchIndex + step + st.matches.length) % st.matches.length;
    $("search-count").textContent = `${st.matchIndex + 1} / ${st.matches.length}`;
    reveal(st.matches[st.matchIndex]);
  }

  // Expand the groups around an element (and show its role), select it and bring it to view.
  function reveal(key) {
    const el = element(M, key);
    let changed = false;
    if (key[0] === "i" && !M.state.roles[el.role]) { M.state.roles[el.role] = true; changed = true; }
    const anc = key[0] === "g" ? (el.parent === undefined ? [] : M.groups[el.parent].anc) : containerOf(M, el).anc;
    for (const gid of anc) {
      if (!M.state.expanded.has(gid)) { M.state.expanded.add(gid); changed = true; }
    }
    if (changed) { render(); buildToggles(); }
    select(key);
    centerOn(visibleOf(M, key) || key);
  }

  // ------------------------------------------------------------------ details panel and tooltip

  const link = (key, text) => `<a data-go="${key}">${esc(text)}</a>`;
  const tag = (text, color) => `<span class="tag" style="background:${color}">${esc(text)}</span>`;

  function irLine(n) {
    const res = n.outputs.map((o) => o.name).join(", ");
    const args = n.inputs.map((o) => o.literal !== undefined ? o.literal : o.value).join(", ");
    const attrs = n.attrs ? " {" + Object.entries(n.attrs).map(([k, v]) => `${k}=${v}`).join(", ") + "}" : "";
    const types = n.outputs.map((o) => o.type + (o.layout ? " " + o.layout : "")).join(", ");
    return `${res} = ${n.op}(${args})${attrs} : ${types}`;
  }

  function refText(op) {
    if (op.literal !== undefined) return `<span class="mono">${esc(op.literal)}</span> <span class="muted">literal</span>`;
    if (op.input !== undefined) {
      const v = M.inputs[op.input];
      return `${link(v.key, op.value)} <span class="muted">${esc(v.role)} · ${esc(op.type)}</span>`;
    }
    const p = M.nodes[op.node];
    return `${link(p.key, op.value)} <span class="muted">= ${esc(p.op)} · ${esc(op.type)}</span>`;
  }

  function usersList(ids) {
    if (!ids.length) return '<span class="muted">none</span>';
    const shown = ids.slice(0, 24).map((id) => link(M.nodes[id].key, `${M.nodes[id].outputs.map((o) => o.name).join(",")} ${M.nodes[id].op}`));
    return shown.join(", ") + (ids.length > 24 ? ` <span class="muted">+${ids.length - 24} more</span>` : "");
  }

  function rows(pairs) {
    return "<table>" + pairs.filter((p) => p[1] !== undefined && p[1] !== null && p[1] !== "")
      .map(([k, v]) => `<tr><td>${esc(k)}</td><td>${v}</td></tr>`).join("") + "</table>";
  }

  function nodeDetails(n) {
    let h = `<h2>${esc(n.op)}</h2><div>${tag(n.kind, kindColor(n.kind))}` +
      (n.phase ? tag(n.phase, phaseColor(n.phase)) : "") +
      (n.kind === "collective" ? tag("communication", "#ffd0d0") : "") + "</div>" +
      `<pre class="ir">${esc(irLine(n))}</pre>`;
    const outBytes = n.outputs.reduce((s, o) => s + o.bytes, 0);
    const gr = n.group !== undefined ? M.groups[n.group] : null;
    h += rows([
      ["module", n.module ? `<span class="mono">${esc(n.module)}</span>` : '<span class="muted">none</span>'],
      ["source", n.loc ? `<span class="mono">${esc(n.loc)}</span>` : '<span class="muted">unknown</span>'],
      ["group", gr ? link(gr.key, gr.label) : null],
      ["FLOPs", n.flops ? `${fmtCount(n.flops, "FLOP")} <span class="muted">(${fmtInt(n.flops)})</span>` : "0"],
      ["output bytes", fmtBytes(outBytes)],
      ["graph output", n.outputRoles.length ? esc(n.outputRoles.join(", ")) : null],
      ...Object.entries(n.info || {}).map(([k, v]) => [k, esc(v)]),
    ]);
    h += "<h3>Outputs</h3><ul>" + n.outputs.map((o) =>
      `<li><span class="mono">${esc(o.name)} : ${esc(o.type)}${o.layout ? " " + esc(o.layout) : ""}</span>` +
      ` <span class="muted">${fmtBytes(o.bytes)}</span></li>`).join("") + "</ul>";
    h += `<h3>Used by (${n.users.length})</h3>${usersList(n.users)}`;
    h += "<h3>Operands</h3><ul>" + (n.inputs.map((op) => `<li>${refText(op)}</li>`).join("") || "<li class=muted>none</li>") + "</ul>";
    if (n.attrs) {
      h += "<h3>Attributes</h3>" + rows(Object.entries(n.attrs).map(([k, v]) => [k, `<span class="mono">${esc(v)}</span>`]));
    }
    return h;
  }

  function inputDetails(v) {
    let h = `<h2>%${esc(v.name)}</h2><div>${tag(v.role, roleColor(v.role))}</div>`;
    h += rows([
      ["type", `<span class="mono">${esc(v.type)}</span>`],
      ["layout", v.layout ? `<span class="mono">${esc(v.layout)}</span>` : null],
      ["elements", fmtInt(v.numel)],
      ["bytes", `${fmtBytes(v.bytes)} <span class="muted">(${fmtInt(v.bytes)})</span>`],
      ["group", v.group !== undefined ? link(M.groups[v.group].key, M.groups[v.group].label) : null],
    ]);
    h += `<h3>Used by (${v.users.length})</h3>${usersList(v.users)}`;
    if (v.outputOf.length) {
      h += "<h3>Graph outputs</h3><ul>" + v.outputOf.map(({ tag: t, out }) =>
        `<li>${out.node !== undefined ? link(M.nodes[out.node].key, out.value) : esc(out.value)} ${esc(t)}</li>`).join("") + "</ul>";
    }
    return h;
  }

  function groupDetails(gr) {
    const open = M.state.expanded.has(gr.id);
    let h = `<h2>${esc(gr.label)}</h2><div>${gr.phase ? tag(gr.phase, phaseColor(gr.phase)) : ""}` +
      `<button type="button" data-toggle="${gr.key}">${open ? "collapse" : "expand"}</button></div>`;
    h += rows([
      ["module", gr.module ? `<span class="mono">${esc(gr.module)}</span>` : null],
      ["nodes", fmtInt(gr.total)],
      ["FLOPs", gr.flops ? `${fmtCount(gr.flops, "FLOP")} <span class="muted">(${fmtInt(gr.flops)})</span>` : "0"],
      ["inside", gr.parent !== undefined ? link(M.groups[gr.parent].key, M.groups[gr.parent].label) : null],
    ]);
    const kinds = Object.entries(gr.kinds).sort((a, b) => b[1] - a[1]);
    h += '<h3>Op kinds</h3><div class="bar">' + kinds.map(([k, c]) =>
      `<span style="width:${(100 * c / gr.total).toFixed(2)}%;background:${kindColor(k)}"></span>`).join("") + "</div>";
    h += rows(kinds.map(([k, c]) => [k, fmtInt(c)]));
    const roles = Object.entries(gr.roles);
    if (roles.length) {
      h += "<h3>Graph inputs drawn here</h3>" + rows(roles.map(([r, s]) => [r, `${fmtInt(s.count)} · ${fmtBytes(s.bytes)}`]));
    }
    if (gr.childGroups.length) {
      h += `<h3>Groups (${gr.childGroups.length})</h3><ul>` + gr.childGroups.slice(0, 40).map((c) =>
        `<li>${link(c.key, c.label)} <span class="muted">${esc(groupStat(c))}</span></li>`).join("") + "</ul>";
    }
    return h;
  }

  function select(key) {
    M.state.selected = key;
    const body = $("details-body");
    if (!key) {
      $("details").hidden = true;
    } else {
      const el = element(M, key);
      body.innerHTML = key[0] === "n" ? nodeDetails(el) : key[0] === "i" ? inputDetails(el) : groupDetails(el);
      $("details").hidden = false;
      body.scrollTop = 0;
    }
    applyMarks();
  }

  function tooltipHtml(key) {
    const el = element(M, key);
    if (key[0] === "n") {
      return `<div class="mono"><b>${esc(el.op)}</b> → ${esc(el.outputs.map((o) => o.name + " : " + o.type + (o.layout ? " " + o.layout : "")).join(", "))}</div>` +
        `<div class="dim">${esc(el.kind)}${el.flops ? " · " + fmtCount(el.flops, "FLOP") : ""}` +
        `${el.module ? " · " + esc(el.module) : ""}${el.loc ? " · " + esc(el.loc) : ""}</div>` +
        (el.info ? `<div class="dim">${esc(Object.entries(el.info).map(([k, v]) => k + " " + v).join(" · "))}</div>` : "");
    }
    if (key[0] === "i") {
      return `<div class="mono"><b>%${esc(el.name)}</b> : ${esc(el.type)}${el.layout ? " " + esc(el.layout) : ""}</div>` +
        `<div class="dim">${esc(el.role)} · ${fmtBytes(el.bytes)} · ${el.users.length} users</div>`;
    }
    return `<div><b>${esc(el.label)}</b></div><div class="dim">${esc(groupStat(el))} · click to ` +
      `${M.state.expanded.has(el.id) ? "collapse" : "expand"}</div>`;
  }

  // ------------------------------------------------------------------ header

  function totalsHtml(s, graphs) {
    const parts = [];
    if (graphs > 1) parts.push(`<span><b>${graphs}</b> graphs</span>`);
    parts.push(`<span><b>${fmtInt(s.nodes)}</b> nodes</span>`);
    parts.push(`<span><b>${fmtInt(s.parameters)}</b> parameters ` +
      `<span class="muted">(${fmtBytes(s.parameter_bytes)} in ${fmtInt(s.parameter_tensors)} tensors)</span></span>`);
    parts.push(`<span><b>${fmtCount(s.flops, "FLOP")}</b></span>`);
    if (s.collectives) {
      parts.push(`<span><b>${fmtInt(s.collectives)}</b> collectives (${fmtBytes(s.collective_bytes)})</span>`);
    }
    return parts.join("");
  }

  function buildHeader() {
    const g = M.g, s = g.summary;
    let html = totalsHtml(s, 1);
    const attrs = attrText(g.attrs);
    if (attrs) html += `<span class="muted">${esc(attrs)}</span>`;
    $("totals").innerHTML = html;
    $("color-by").value = M.state.colorBy;
    buildLegend();
    buildToggles();
  }

  function buildLegend() {
    const s = M.g.summary, by = M.state.colorBy;
    let chips = [];
    if (by === "kind") {
      chips = Object.entries(s.kinds).map(([k, c]) => [kindColor(k), k, c, "kind:" + k]);
    } else if (by === "stage") {
      const stages = Object.entries(s.stages || {});
      chips = stages.map(([st, c]) => [stageFill(Number(st)), "stage " + st, c, "stage:" + st]);
      if (!chips.length) chips.push(["#fff", "no stages (not a sliced training graph)", "", ""]);
    } else if (by === "phase") {
      chips = PHASES.filter((p) => s.phases[p]).map((p) => [phaseColor(p), p, s.phases[p], "phase:" + p]);
      if (!chips.length) chips.push(["#fff", "no phases (not a training graph)", "", ""]);
    } else {
      chips = M.layouts.map((l) => [M.layoutColor.get(l), l, s.layouts[l], "layout:" + l]);
      if (!chips.length) chips.push(["#fff", "no layouts yet (run a sharding pass)", "", ""]);
    }
    $("legend").innerHTML = chips.map(([color, label, count, q]) =>
      `<span class="chip" data-q="${esc(q)}" title="${q ? "search " + esc(q) : ""}"><i style="background:${color}"></i>` +
      `${esc(label)} <span class="n">${count === "" ? "" : fmtInt(count)}</span></span>`).join("");
  }

  function buildToggles() {
    const roles = M.g.summary.roles;
    $("role-toggles").innerHTML = ROLES.filter((r) => roles[r]).map((r) =>
      `<label title="draw the ${r} inputs (${fmtInt(roles[r].count)}, ${fmtBytes(roles[r].bytes)})"><input type="checkbox" data-role="${r}"${M.state.roles[r] ? " checked" : ""}> ` +
      `${r} <span class="muted">${fmtInt(roles[r].count)}</span></label>`).join("") +
      (M.savedCount ? `<label title="draw the edges from forward values to the backward nodes that read them">` +
        `<input type="checkbox" data-saved="1"${M.state.saved ? " checked" : ""}> saved activations ` +
        `<span class="muted">${fmtInt(M.savedCount)}</span></label>` : "");
  }

  // graph attributes as printed in the IR, strings without their quotes: "stage=0 device=gpu1"
  const attrText = (attrs) => Object.entries(attrs)
    .map(([k, v]) => `${k}=${/^"[^"]*"$/.test(v) ? v.slice(1, -1) : v}`).join(" ");

  function buildTabs() {
    const tabs = $("tabs");
    if (DATA.graphs.length < 2 && !DATA.pipeline) return;
    tabs.hidden = false;
    const pipeTab = DATA.pipeline ? '<button type="button" data-tab="pipeline">pipeline ' +
      `<span class="n">${DATA.pipeline.stages.length} stages</span></button>` : "";
    tabs.innerHTML = pipeTab + DATA.graphs.map((g, i) => {
      const attrs = attrText(g.attrs);
      return `<button type="button" data-tab="${i}">@${esc(g.name)}${attrs ? " · " + esc(attrs) : ""}` +
        ` <span class="n">${fmtInt(g.summary.nodes)}</span></button>`;
    }).join("") + `<span class="totals program">all graphs: ${totalsHtml(DATA.totals, DATA.totals.graphs)}</span>`;
  }

  function show(i) {
    current = i;
    if (pipelineShown) hidePipeline();
    if (!models[i]) models[i] = prepare(DATA.graphs[i]);
    M = models[i];
    for (const b of $("tabs").querySelectorAll("button")) b.classList.toggle("active", Number(b.dataset.tab) === i);
    buildHeader();
    $("search").value = M.state.query;
    render();
    if (!M.state.view) fit(false); else applyView();
    select(M.state.selected);
    runSearch(M.state.query);
  }


  // ------------------------------------------------------------------ the pipeline view
  //
  // An MPMD program (DATA.pipeline): one horizontal band per stage, coloured by its sub-mesh,
  // with its forward, backward and update graphs as boxes in three columns; matched send/recv
  // pairs are arrows between the boxes (one arrow per pair of graphs, its count and bytes).

  const P = DATA.pipeline;
  const PIPE_PHASES = ["forward", "backward", "update"];
  const PIPE_EDGE = { forward: "#2563eb", backward: "#d9480f", update: "#3c9149" };
  const BAND_H = 104, BAND_GAP = 34, LABEL_W = 320, BOX_W = 230, BOX_H = 58, COL_GAP = 90;

  const span = (ids) => ids.length === 1 ? String(ids[0]) :
    ids.every((d, i) => i === 0 || d === ids[i - 1] + 1) ? `${ids[0]}-${ids[ids.length - 1]}` :
      ids.join(",");
  const fmtSeconds = (t) => t >= 1 ? t.toFixed(3) + " s" : t >= 1e-3 ? (t * 1e3).toFixed(3) + " ms" :
    (t * 1e6).toFixed(2) + " µs";

  function bandLines(b) {
    const lines = [`sub-mesh ${b.shape} · devices ${span(b.devices)}`,
      `${fmtInt(b.nodes)} nodes · ${fmtCount(b.flops, "FLOP")}`];
    const est = [];
    if (b.est_seconds !== undefined) est.push(fmtSeconds(b.est_seconds) + "/microbatch");
    if (b.mem_bytes !== undefined) est.push(fmtBytes(b.mem_bytes) + "/device");
    if (est.length) lines.push(est.join(" · ") + " (est.)");
    return lines;
  }

  function pipelineSvg() {
    const boxes = new Map();  // graph index -> {x, y, w, h}
    const out = [];
    const width = LABEL_W + PIPE_PHASES.length * (BOX_W + COL_GAP);
    P.stages.forEach((b, row) => {
      const y = row * (BAND_H + BAND_GAP);
      out.push(`<g class="band" data-stage="${b.stage}" data-submesh="${b.submesh}">` +
        `<rect class="band-bg" x="0" y="${y}" width="${width}" height="${BAND_H}" rx="8" ` +
        `style="fill:${b.color}22;stroke:${b.color}"/>` +
        `<rect x="0" y="${y}" width="8" height="${BAND_H}" rx="3" style="fill:${b.color}"/>` +
        `<text class="band-title" x="20" y="${y + 24}">stage ${b.stage}</text>` +
        bandLines(b).map((line, i) =>
          `<text class="band-stat" x="20" y="${y + 44 + 17 * i}">${esc(line)}</text>`).join("") +
        "</g>");
      for (const gr of b.graphs) {
        const col = PIPE_PHASES.indexOf(gr.phase);
        const x = LABEL_W + Math.max(col, 0) * (BOX_W + COL_GAP), by = y + (BAND_H - BOX_H) / 2;
        boxes.set(gr.graph, { x, y: by, w: BOX_W, h: BOX_H });
        out.push(`<g class="stage-graph ph-${gr.phase}" data-graph="${gr.graph}">` +
          `<rect class="body" x="${x}" y="${by}" width="${BOX_W}" height="${BOX_H}" rx="6" ` +
          `style="stroke:${b.color}"/>` +
          `<text class="label" x="${x + 10}" y="${by + 20}">${esc(gr.phase)}</text>` +
          `<text class="name" x="${x + BOX_W - 10}" y="${by + 20}" text-anchor="end">@${esc(gr.name)}</text>` +
          `<text class="stat" x="${x + 10}" y="${by + 42}">${fmtInt(gr.nodes)} ` +
          `node${gr.nodes === 1 ? "" : "s"} · ` +
          `${fmtCount(gr.flops, "FLOP")}</text></g>`);
      }
    });
    // one arrow per (sending graph, receiving graph), offset so the two directions part
    const pairs = new Map();
    for (const t of P.transfers) {
      const k = t.src.graph + ">" + t.dst.graph;
      if (!pairs.has(k)) pairs.set(k, { t, list: [] });
      pairs.get(k).list.push(t);
    }
    for (const { t, list } of pairs.values()) {
      const a = boxes.get(t.src.graph), z = boxes.get(t.dst.graph);
      if (!a || !z) continue;
      const down = t.dst.stage > t.src.stage;
      const dx = t.phase === "backward" ? 0.62 : t.phase === "update" ? 0.5 : 0.38;
      const sx = a.x + a.w * dx + (down ? -8 : 8), tx = z.x + z.w * dx + (down ? -8 : 8);
      const sy = down ? a.y + a.h : a.y, ty = down ? z.y : z.y + z.h;
      const hops = Math.abs(t.dst.stage - t.src.stage);
      // across more than one band the arrow bows right, past the boxes in between
      const bow = hops > 1 ? BOX_W / 2 + 24 * hops : 0;
      const d = `M${sx} ${sy}C${sx + bow} ${sy + (down ? 40 : -40)} ${tx + bow} ` +
        `${ty + (down ? -40 : 40)} ${tx} ${ty}`;
      const bytes = list.reduce((acc, x) => acc + x.bytes, 0);
      const label = `${list.length > 1 ? list.length + " × " : ""}${list.length > 1 ? "" : list[0].type + " · "}${fmtBytes(bytes)}`;
      const title = list.map((x) => `${x.phase} tag ${x.tag}: ${x.type} (${fmtBytes(x.bytes)}), ` +
        `stage ${x.src.stage} %${x.src.node} → stage ${x.dst.stage} %${x.dst.node}`).join("\n");
      const mx = (sx + tx) / 2 + bow * 0.75, my = (sy + ty) / 2;
      out.push(`<g class="transfer ph-${t.phase}" data-src="${t.src.graph}" data-dst="${t.dst.graph}">` +
        `<path d="${d}" style="stroke:${PIPE_EDGE[t.phase] || "#666"}" marker-end="url(#parrow)"/>` +
        `<text x="${mx + 6}" y="${my + 4}">${esc(label)}</text><title>${esc(title)}</title></g>`);
    }
    const height = P.stages.length * (BAND_H + BAND_GAP);
    return `<svg class="pipeline-svg" width="${width + 140}" height="${height}" ` +
      `viewBox="-10 -10 ${width + 140} ${height}">` +
      '<defs><marker id="parrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" ' +
      'markerHeight="7" orient="auto-start-reverse"><path d="M0 1L10 5L0 9z" fill="#555"/>' +
      "</marker></defs>" + out.join("") + "</svg>";
  }

  function pipelineNote() {
    const counts = {};
    for (const t of P.transfers) counts[t.phase] = (counts[t.phase] || 0) + 1;
    const sent = P.transfers.reduce((acc, t) => acc + t.bytes, 0);
    let html = `<p class="muted">${P.stages.length} stages on ${P.submeshes.length} sub-meshes · ` +
      `${P.transfers.length} send/recv pairs (${Object.entries(counts).map(([k, c]) => c + " " + k).join(", ")}) ` +
      `moving ${fmtBytes(sent)} per microbatch · click a graph to open it</p>`;
    if (P.token_slices) {
      html += `<p class="muted">token slices (TeraPipe): each sequence cut into ` +
        `${P.token_slices.length} slices of [${P.token_slices.join(", ")}] tokens, ` +
        `microbatches of [${(P.batch_slices || []).join(", ")}] sequences; ` +
        `every stage runs the (microbatch, slice) units in order</p>`;
    }
    if (P.unmatched.length) {
      html += `<p class="error-inline">${P.unmatched.length} unmatched: ` +
        esc(P.unmatched.map((u) => `${u.op} in stage ${u.stage} (%${u.node}, tag ${u.tag})`).join(", ")) + "</p>";
    }
    return html;
  }

  let pipelineShown = false;
  function showPipeline() {
    pipelineShown = true;
    const view = $("pipeline");
    if (!view.innerHTML) view.innerHTML = pipelineNote() + pipelineSvg();
    view.hidden = false;
    document.body.classList.add("pipeline-mode");
    for (const b of $("tabs").querySelectorAll("button")) b.classList.toggle("active", b.dataset.tab === "pipeline");
    // totals over the stage graphs only: a global graph on the page is the same step again
    const nodes = P.stages.reduce((acc, b) => acc + b.nodes, 0);
    const flops = P.stages.reduce((acc, b) => acc + b.flops, 0);
    $("totals").innerHTML = `<span><b>${P.stages.length}</b> stages</span>` +
      `<span><b>${P.submeshes.length}</b> sub-meshes</span>` +
      `<span><b>${fmtInt(nodes)}</b> nodes in stage graphs</span>` +
      `<span><b>${fmtCount(flops, "FLOP")}</b></span>`;
    $("legend").innerHTML = P.submeshes.map((m) =>
      `<span class="chip"><i style="background:${m.color}"></i>sub-mesh ${esc(m.shape)} · devices ` +
      `${esc(span(m.devices))}</span>`).join("") +
      PIPE_PHASES.map((p) => `<span class="chip"><i style="background:${PIPE_EDGE[p]}"></i>${p} send → recv</span>`).join("");
    $("role-toggles").innerHTML = "";
  }
  function hidePipeline() {
    pipelineShown = false;
    $("pipeline").hidden = true;
    document.body.classList.remove("pipeline-mode");
  }
  $("pipeline").addEventListener("click", (e) => {
    const box = e.target.closest("[data-graph]");
    if (box) show(Number(box.dataset.graph));
  });

  // ------------------------------------------------------------------ events

  let drag = null;
  svg.addEventListener("mousedown", (e) => {
    if (e.button !== 0) return;
    drag = { x: e.clientX, y: e.clientY, vx: M.state.view.x, vy: M.state.view.y, moved: false };
  });
  window.addEventListener("mousemove", (e) => {
    if (drag) {
      const dx = e.clientX - drag.x, dy = e.clientY - drag.y;
      if (Math.abs(dx) + Math.abs(dy) > 4) { drag.moved = true; svg.classList.add("panning"); }
      if (drag.moved) {
        M.state.view.x = drag.vx + dx;
        M.state.view.y = drag.vy + dy;
        applyView();
      }
    }
    const tip = $("tooltip");
    if (!tip.hidden) {
      tip.style.left = Math.min(e.clientX + 14, window.innerWidth - tip.offsetWidth - 8) + "px";
      tip.style.top = Math.min(e.clientY + 16, window.innerHeight - tip.offsetHeight - 8) + "px";
    }
  });
  window.addEventListener("mouseup", () => {
    setTimeout(() => { drag = null; }, 0);
    svg.classList.remove("panning");
  });
  svg.addEventListener("click", (e) => {
    if (drag && drag.moved) return;
    const target = e.target.closest("[data-key]");
    if (!target) { select(null); return; }
    const key = target.getAttribute("data-key");
    if (key[0] === "g" && (target.classList.contains("head") || target.classList.contains("group-box"))) {
      toggleGroup(key);
    } else if (key[0] !== "g") {
      select(key);
    }
  });
  svg.addEventListener("wheel", (e) => {
    e.preventDefault();
    const r = svg.getBoundingClientRect();
    if (e.ctrlKey || e.metaKey) {
      zoomAt(Math.exp(-e.deltaY * 0.0025), e.clientX - r.left, e.clientY - r.top);
    } else {
      M.state.view.x -= e.shiftKey ? e.deltaY : e.deltaX;
      M.state.view.y -= e.shiftKey ? 0 : e.deltaY;
      applyView();
    }
  }, { passive: false });
  svg.addEventListener("mouseover", (e) => {
    const target = e.target.closest("[data-key]");
    const tip = $("tooltip");
    if (!target || target.classList.contains("cluster")) { tip.hidden = true; return; }
    tip.innerHTML = tooltipHtml(target.getAttribute("data-key"));
    tip.hidden = false;
  });
  svg.addEventListener("mouseleave", () => { $("tooltip").hidden = true; });

  function toggleGroup(key) {
    const id = Number(key.slice(1));
    if (M.state.expanded.has(id)) M.state.expanded.delete(id);  // inner groups keep their state
    else M.state.expanded.add(id);
    $("tooltip").hidden = true;
    relayoutAnchored(key);
    select(key);
  }

  $("details").addEventListener("click", (e) => {
    const go = e.target.closest("[data-go]");
    if (go) { reveal(go.getAttribute("data-go")); return; }
    const toggle = e.target.closest("[data-toggle]");
    if (toggle) toggleGroup(toggle.getAttribute("data-toggle"));
  });
  $("close-details").addEventListener("click", () => select(null));
  $("legend").addEventListener("click", (e) => {
    const chip = e.target.closest("[data-q]");
    if (!chip || !chip.dataset.q) return;
    $("search").value = chip.dataset.q;
    runSearch(chip.dataset.q);
  });
  $("tabs").addEventListener("click", (e) => {
    const b = e.target.closest("[data-tab]");
    if (b && b.dataset.tab === "pipeline") showPipeline();
    else if (b) show(Number(b.dataset.tab));
  });
  $("role-toggles").addEventListener("change", (e) => {
    const role = e.target.dataset.role;
    if (role) M.state.roles[role] = e.target.checked;
    else if (e.target.dataset.saved) M.state.saved = e.target.checked;
    else return;
    render();
  });
  $("color-by").addEventListener("change", (e) => {
    M.state.colorBy = e.target.value;
    buildLegend();
    render();
  });
  $("btn-expand-all").addEventListener("click", () => {
    for (const gr of M.groups) M.state.expanded.add(gr.id);
    render();
    fit(false);
  });
  $("btn-collapse-all").addEventListener("click", () => {
    M.state.expanded.clear();
    render();
    fit(false);
  });
  $("btn-fit").addEventListener("click", () => fit(true));
  let searchTimer = 0;
  $("search").addEventListener("input", (e) => {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(() => runSearch(e.target.value), 120);
  });
  $("search").addEventListener("keydown", (e) => {
    if (e.key === "Enter") {
      clearTimeout(searchTimer);
      if (M.state.query !== e.target.value.trim()) runSearch(e.target.value);
      nextMatch(e.shiftKey ? -1 : 1);
    } else if (e.key === "Escape") {
      e.target.value = "";
      runSearch("");
      e.target.blur();
    }
  });
  window.addEventListener("keydown", (e) => {
    if (e.target.tagName === "INPUT" || e.target.tagName === "SELECT") return;
    if (e.key === "/") { e.preventDefault(); $("search").focus(); }
    else if (e.key === "f") fit(true);
    else if (e.key === "Escape") select(null);
    else if (e.key === "+" || e.key === "=") zoomAt(1.25, svg.clientWidth / 2, svg.clientHeight / 2);
    else if (e.key === "-") zoomAt(0.8, svg.clientWidth / 2, svg.clientHeight / 2);
  });

  // #selftest: drive every control once (clicks, toggles, search, tabs) and report on <body>,
  // so a headless browser can check the interactive code without a driver.
  function selfTest() {
    const click = (el) => el && el.dispatchEvent(new MouseEvent("click", { bubbles: true }));
    const over = (el) => el && el.dispatchEvent(new MouseEvent("mouseover", { bubbles: true }));
    for (let i = 0; i < DATA.graphs.length; i++) {
      click($("tabs").querySelector(`[data-tab="${i}"]`));
      if (current !== i) show(i);
      for (const by of ["phase", "layout", "stage", "kind"]) {
        $("color-by").value = by;
        $("color-by").dispatchEvent(new Event("change"));
      }
      for (const box of $("role-toggles").querySelectorAll("input")) {
        box.checked = !box.checked;
        box.dispatchEvent(new Event("change", { bubbles: true }));
      }
      for (const gr of M.groups.slice(0, 4)) {
        click(drawn.dom.get(visibleOf(M, "g" + gr.id) || "") || null);
        const head = svg.querySelector(`.cluster[data-key="g${gr.id}"] > .head`);
        click(head);
        click(head && svg.querySelector(`[data-key="g${gr.id}"]`));
      }
      for (const el of [...svg.querySelectorAll(".node, .input, .group-box")].slice(0, 5)) {
        over(el);
        click(el);
        click($("details-body").querySelector("[data-go]"));
      }
      if (M.nodes.length) {
        $("search").value = M.nodes[M.nodes.length - 1].op;
        runSearch($("search").value);
        nextMatch(1);
        nextMatch(-1);
        click($("legend").querySelector("[data-q]"));
      }
      click($("btn-expand-all"));
      click($("btn-collapse-all"));
      click($("btn-fit"));
      zoomAt(1.5, 100, 100);
      click($("close-details"));
    }
    if (P) {
      click($("tabs").querySelector('[data-tab="pipeline"]'));
      for (const box of [...$("pipeline").querySelectorAll("[data-graph]")]) {
        click(box);
        click($("tabs").querySelector('[data-tab="pipeline"]'));
      }
      if (!pipelineShown) throw new Error("the pipeline tab did not open the pipeline view");
    }
    document.body.setAttribute("data-selftest", "ok");
  }

  // Options in the address, for links and screenshots:
  // #graph=1&show=param,saved&expand&fit&search=matmul
  const opts = new URLSearchParams(location.hash.slice(1));
  buildTabs();
  if (DATA.graphs.length) {
    show(Math.min(Number(opts.get("graph")) || 0, DATA.graphs.length - 1));
    for (const what of (opts.get("show") || "").split(",").filter(Boolean)) {
      if (what === "saved") M.state.saved = true; else M.state.roles[what] = true;
    }
    if (opts.has("show")) { buildToggles(); render(); }
    if (opts.has("expand")) { for (const gr of M.groups) M.state.expanded.add(gr.id); render(); fit(false); }
    if (opts.has("fit")) fit(true);
    if (opts.get("search")) {  // and go to the first match
      $("search").value = opts.get("search");
      runSearch(opts.get("search"));
      nextMatch(1);
    }
    if (P && !opts.has("graph") && !opts.has("selftest")) showPipeline();
    if (opts.has("selftest")) selfTest();
  }
  document.body.setAttribute("data-ready", "true");
})();
