/* PagedKV Lab's pool viewer: one file, two homes.
 *
 * On the book's site this file is a classic script (copied into _static/ and
 * loaded by pagedkv_lab._sphinx on the pages that have a viewer): it mounts
 * every <div class="pkv-viewer"> that holds a <script type="application/json"
 * class="pkv-trace">, and replays that trace with no kernel and no network.
 * In JupyterLab, Notebook and Colab, anywidget loads the same text as an ES
 * module (pagedkv_lab.course.poolviewer appends `export default
 * globalThis.PagedKVViewer`) and calls render({model, el}); a setting the trace
 * has no run for is asked of the kernel, which simulates it and sends it back.
 *
 * The trace format, "pagedkv-trace/1", is documented in
 * pagedkv_lab/course/poolviewer.py and pagedkv_lab/course/traces.py.
 */
(function () {
  "use strict";

  // Trace decoding and replay: pure functions, tested under node ------------------

  function runKey(values) {
    return values.map(String).join("|");
  }

  /** A ``[value, count, value, count, ...]`` column, expanded. */
  function expand(rle) {
    const out = [];
    for (let i = 0; i < rle.length; i += 2) {
      for (let k = 0; k < rle[i + 1]; k++) out.push(rle[i]);
    }
    return out;
  }

  const decoded = new WeakMap();

  /** A ``cells`` run with its repeated frames (``0``) and its columns expanded. */
  function decodeCells(run) {
    if (!decoded.has(run)) {
      let previous = null;
      const frames = run.frames.map((f) => (previous = f === 0 ? previous : f));
      const values = {};
      for (const [name, column] of Object.entries(run.values || {})) {
        values[name] = expand(column);
      }
      decoded.set(run, { frames, values });
    }
    return decoded.get(run);
  }

  function inRanges(flat, step) {
    for (let i = 0; i < flat.length; i += 2) {
      if (flat[i] <= step && step <= flat[i + 1]) return true;
    }
    return false;
  }

  /** A contiguous pool at ``step``: its runs of slots in states, and its counts. */
  function replaySlots(run, step) {
    const r = run.requests;
    const v = { capacity: run.capacity, used: 0, running: 0, waiting: 0, finished: 0 };
    const segments = [];
    const regions = [];
    for (let i = 0; i < r.length; i += 8) {
      const [arrival, admit, finish, start, length, asked, final, prompt] = r.slice(i, i + 8);
      if (finish < step) {
        v.finished++;
        continue;
      }
      if (admit > step) {
        if (arrival <= step) v.waiting++;
        continue;
      }
      v.running++;
      const held = Math.min(prompt + step - admit + 1, asked);
      const willUse = Math.min(asked, final);
      v.used += held;
      const cuts = [["used", 0, held], ["reserved", held, willUse],
        ["internal", willUse, asked], ["rounding", asked, length]];
      for (const [state, a, b] of cuts) {
        if (b > a) segments.push([start + a, b - a, state]);
      }
      regions.push([start, length]);
    }
    regions.sort((a, b) => a[0] - b[0]);
    const gap = inRanges(run.blocked, step) ? "external" : "free";
    let cursor = 0;
    for (const [start, length] of regions.concat([[run.capacity, 0]])) {
      if (start > cursor) segments.push([cursor, start - cursor, gap]);
      cursor = Math.max(cursor, start + length);
    }
    segments.sort((a, b) => a[0] - b[0]);
    return { values: v, segments, regions };
  }

  /** A paged pool at ``step``: each block's owner and fill, and its counts. */
  function replayBlocks(run, step) {
    const bs = run.block_size;
    const owners = new Array(run.blocks).fill(null);
    const v = { capacity: run.blocks * bs, used: 0, blocks_used: 0,
      running: 0, waiting: 0, finished: 0 };
    const tables = [];
    run.requests.forEach((req, rid) => {
      const [arrival, final] = req;
      const spells = req.slice(2);
      if (spells[spells.length - 1][1] < step) {
        v.finished++; // its last spell is the one it finishes in
        return;
      }
      const spell = spells.find((s) => s[0] <= step && step <= s[1]);
      if (!spell) {
        if (arrival <= step) v.waiting++;
        return;
      }
      v.running++;
      const held = spell[2] + step - spell[0] + 1;
      const n = Math.ceil(held / bs);
      const table = spell.slice(3, 3 + n);
      v.used += held;
      v.blocks_used += n;
      table.forEach((block, i) => {
        owners[block] = [rid, Math.min(bs, held - i * bs), Math.min(bs, final - i * bs)];
      });
      tables.push([rid, table]);
    });
    return { values: v, owners, tables };
  }

  /** A frame-by-frame pool at ``step``: its groups of cells and its values. */
  function replayCells(view, run, step) {
    const { frames, values } = decodeCells(run);
    const i = Math.max(0, Math.min(step, frames.length - 1));
    const groups = frames[i].map((g, k) =>
      Object.assign({}, (view.groups || [])[k] || {}, typeof g === "string" ? { cells: g } : g));
    const v = {};
    for (const [name, column] of Object.entries(values)) v[name] = column[i];
    const ids = new Set();
    let entries = 0;
    for (const g of groups) {
      entries += g.cells.length;
      for (const ch of g.cells) v["count_" + ch] = (v["count_" + ch] || 0) + 1;
      (g.ids || []).forEach((id) => ids.add(id));
    }
    v.held = ids.size;
    v.table_entries = entries;
    return { values: v, groups, frame: i };
  }

  /** What ``view`` shows at ``step`` of ``run``: ``values`` and what to draw. */
  function replay(view, run, step) {
    if (view.kind === "slots") return replaySlots(run, step);
    if (view.kind === "blocks") return replayBlocks(run, step);
    return replayCells(view, run, step);
  }

  /** A headline item's numerator and denominator at ``step``. */
  function headlineValue(item, view, run, state, step) {
    if (item.cumulative) {
      const { values } = decodeCells(run);
      const upto = (name) => values[name].slice(0, state.frame + 1).reduce((a, b) => a + b, 0);
      return [upto(item.key), item.den ? upto(item.den) : null];
    }
    return [state.values[item.key] ?? 0, item.den ? state.values[item.den] : null];
  }

  /** Every headline number of ``view`` at ``step``, as ``{label: [num, den]}``. */
  function headline(view, run, step) {
    const state = replay(view, run, step);
    const out = {};
    for (const item of view.headline) out[item.label] = headlineValue(item, view, run, state, step);
    return out;
  }

  // Drawing -----------------------------------------------------------------------

  const FONT = "12px system-ui, -apple-system, 'Segoe UI', sans-serif";

  function hatchPattern(ctx, bg, line, cross) {
    const tile = document.createElement("canvas");
    tile.width = tile.height = 8;
    const t = tile.getContext("2d");
    t.fillStyle = bg;
    t.fillRect(0, 0, 8, 8);
    t.strokeStyle = line;
    t.lineWidth = 1.2;
    t.beginPath();
    for (const [x0, y0, x1, y1] of [[-2, 10, 10, -2], [-2, 2, 2, -2], [6, 10, 10, 6]]) {
      t.moveTo(x0, y0);
      t.lineTo(x1, y1);
    }
    if (cross) {
      for (const [x0, y0, x1, y1] of [[-2, -2, 10, 10], [6, -2, 10, 2], [-2, 6, 2, 10]]) {
        t.moveTo(x0, y0);
        t.lineTo(x1, y1);
      }
    }
    t.stroke();
    return ctx.createPattern(tile, "repeat");
  }

  /** The canvas fill of the legend entry of ``state``: its colour, or its hatch. */
  function stateFill(ctx, view, state) {
    const entry = view.legend.find((e) => e.state === state);
    if (!entry.hatch) return entry.fill;
    return hatchPattern(ctx, entry.fill, entry.edge || "#ffffff", entry.hatch.includes("x"));
  }

  function sizeCanvas(canvas, width, height) {
    const dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
    canvas.style.width = width + "px";
    canvas.style.height = height + "px";
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = FONT;
    ctx.textBaseline = "middle";
    return ctx;
  }

  function drawSlots(canvas, width, view, run, state) {
    const rows = Math.ceil(run.capacity / run.row);
    const rowH = 18, gap = 5;
    const height = rows * (rowH + gap) + 18;
    const ctx = sizeCanvas(canvas, width, height);
    const fills = {};
    for (const s of ["used", "reserved", "internal", "rounding", "external", "free"]) {
      fills[s] = stateFill(ctx, view, s);
    }
    const scale = width / run.row;
    for (let [start, length, s] of state.segments) {
      while (length > 0) {
        const row = Math.floor(start / run.row), col = start % run.row;
        const n = Math.min(length, run.row - col);
        ctx.fillStyle = fills[s];
        ctx.fillRect(col * scale, row * (rowH + gap), n * scale, rowH);
        start += n;
        length -= n;
      }
    }
    ctx.fillStyle = "#ffffff";
    for (const [start, length] of state.regions) {
      for (const edge of [start, start + length]) {
        const row = Math.floor(edge / run.row), col = edge % run.row;
        if (col > 0) ctx.fillRect(col * scale - 0.75, row * (rowH + gap), 1.5, rowH);
      }
    }
    ctx.fillStyle = "#57606a";
    ctx.textAlign = "center";
    ctx.fillText(`each row: ${run.row.toLocaleString("en-US")} token slots`, width / 2, height - 8);
  }

  function drawBlock(ctx, x, y, size, owner, bs, color, fills) {
    const [, filled, will] = owner;
    ctx.fillStyle = "#ffffff";
    ctx.fillRect(x, y, size, size);
    const part = (n) => (size * n) / bs;
    const willFill = Math.max(filled, will);
    if (willFill > filled) {
      ctx.fillStyle = fills.reserved;
      ctx.fillRect(x + part(filled), y, part(willFill - filled), size);
    }
    if (bs > willFill) {
      ctx.fillStyle = fills.internal;
      ctx.fillRect(x + part(willFill), y, part(bs - willFill), size);
    }
    ctx.fillStyle = color;
    ctx.fillRect(x, y, part(filled), size);
    if (size >= 6) {
      ctx.strokeStyle = color;
      ctx.lineWidth = 1;
      ctx.strokeRect(x + 0.5, y + 0.5, size - 1, size - 1);
    }
  }

  function drawBlocks(canvas, width, view, run, state) {
    const n = run.blocks;
    const columns = n <= 256 ? 16 : n <= 512 ? 32 : 64;
    const size = Math.max(3, Math.min(30, Math.floor(width / columns) - 1));
    const rows = Math.ceil(n / columns);
    const height = rows * (size + 1) + 2;
    const ctx = sizeCanvas(canvas, width, height);
    const fills = { reserved: stateFill(ctx, view, "reserved"), internal: stateFill(ctx, view, "internal") };
    const ids = n <= 256 && size >= 22;
    ctx.textAlign = "center";
    for (let b = 0; b < n; b++) {
      const x = (b % columns) * (size + 1), y = Math.floor(b / columns) * (size + 1);
      const owner = state.owners[b];
      if (owner === null) {
        ctx.fillStyle = view.free;
        ctx.fillRect(x, y, size, size);
      } else {
        const color = view.owners[owner[0] % view.owners.length];
        drawBlock(ctx, x, y, size, owner, run.block_size, color, fills);
      }
      if (ids) {
        ctx.fillStyle = owner && owner[1] >= run.block_size ? "#ffffff" : "#333333";
        ctx.fillText(String(b), x + size / 2, y + size / 2 + 1);
      }
    }
  }

  function cellColor(view, ch) {
    if (view.owners) return ch === "." ? view.free : view.owners[parseInt(ch, 36) % view.owners.length];
    return view.codes[ch];
  }

  /** Beams as rows (chapter 07): each block filled as far as it holds tokens. */
  function drawCellRows(canvas, width, view, run, state) {
    const { frames } = decodeCells(run);
    const rows = Math.max(...frames.map((f) => f.length));
    const widest = Math.max(...frames.flat().map((g) => g.cells.length));
    const label = 96;
    const size = Math.max(16, Math.min(view.cell || 40, Math.floor((width - label) / widest) - 6));
    const height = rows * (size * 0.8 + 8) + 4;
    const ctx = sizeCanvas(canvas, width, height);
    const bs = run.block_size;
    state.groups.forEach((g, r) => {
      const y = 2 + r * (size * 0.8 + 8), h = size * 0.8;
      ctx.textAlign = "right";
      ctx.fillStyle = g.dim ? "#8c959f" : "#1f2328";
      ctx.fillText(g.label + (g.dim ? " (ends)" : ""), label - 8, y + h / 2);
      [...g.cells].forEach((ch, i) => {
        const x = label + i * (size + 6);
        const color = cellColor(view, ch);
        ctx.fillStyle = "#ffffff";
        ctx.fillRect(x, y, size, h);
        ctx.fillStyle = color;
        ctx.fillRect(x, y, (size * (g.fill ? g.fill[i] : bs)) / bs, h);
        ctx.strokeStyle = color;
        ctx.lineWidth = 1;
        ctx.setLineDash([]);
        ctx.strokeRect(x + 0.5, y + 0.5, size - 1, h - 1);
        const mark = g.mark ? g.mark[i] : "-";
        if (mark !== "-") {
          ctx.strokeStyle = mark === "c" ? "#000000" : "#e69f00";
          ctx.lineWidth = 2.5;
          ctx.setLineDash(mark === "w" ? [5, 3] : []);
          ctx.strokeRect(x + 1.25, y + 1.25, size - 2.5, h - 2.5);
          ctx.setLineDash([]);
        }
        if (g.ids) {
          const text = String(g.ids[i]);
          const tw = ctx.measureText(text).width + 6;
          ctx.fillStyle = "#ffffff";
          ctx.fillRect(x + size / 2 - tw / 2, y + h / 2 - 8, tw, 16);
          ctx.fillStyle = "#222222";
          ctx.textAlign = "center";
          ctx.fillText(text, x + size / 2, y + h / 2 + 1);
        }
      });
    });
  }

  /** Groups of square cells side by side (chapters 08 and 09). */
  function drawCellGrids(canvas, width, view, run, state) {
    const groups = state.groups;
    const cols = groups.map((g) => g.columns || 16);
    const gap = 24;
    const totalCols = cols.reduce((a, b) => a + b, 0);
    const size = Math.max(8, Math.min(view.cell || 22,
      Math.floor((width - gap * (groups.length - 1)) / totalCols) - 2));
    const rowsOf = (g, k) => Math.ceil(g.cells.length / cols[k]);
    const top = groups.some((g) => g.label) ? 18 : 0;
    const height = top + Math.max(...groups.map((g, k) => rowsOf(g, k))) * (size + 2) + 2;
    const ctx = sizeCanvas(canvas, width, height);
    let x0 = 0;
    groups.forEach((g, k) => {
      if (g.label) {
        ctx.fillStyle = "#1f2328";
        ctx.textAlign = "left";
        ctx.fillText(g.label, x0, 8);
      }
      [...g.cells].forEach((ch, i) => {
        ctx.fillStyle = cellColor(view, ch);
        ctx.fillRect(x0 + (i % cols[k]) * (size + 2), top + Math.floor(i / cols[k]) * (size + 2), size, size);
      });
      x0 += cols[k] * (size + 2) + gap;
    });
  }

  function draw(canvas, width, view, run, state) {
    if (view.kind === "slots") return drawSlots(canvas, width, view, run, state);
    if (view.kind === "blocks") return drawBlocks(canvas, width, view, run, state);
    if (view.layout === "rows") return drawCellRows(canvas, width, view, run, state);
    return drawCellGrids(canvas, width, view, run, state);
  }

  // The page: controls, time, views, legend ---------------------------------------

  const CSS = `
.pkv-viewer{border:1px solid #d0d7de;border-radius:6px;padding:10px 12px;margin:1em 0;
  background:#fff;color:#1f2328;font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif}
.pkv-viewer .pkv-title{font-weight:600;margin-bottom:4px}
.pkv-viewer .pkv-row{display:flex;flex-wrap:wrap;gap:6px 14px;align-items:center;margin:6px 0}
.pkv-viewer label{display:inline-flex;gap:6px;align-items:center;margin:0}
.pkv-viewer select,.pkv-viewer button{font:inherit;font-size:13px;padding:2px 8px;border:1px solid #8c959f;
  border-radius:4px;background:#f6f8fa;color:#1f2328;cursor:pointer}
.pkv-viewer button:hover,.pkv-viewer select:hover{background:#eaeef2}
.pkv-viewer button:disabled{opacity:.45;cursor:default}
.pkv-viewer input[type=range]{flex:1 1 220px;min-width:160px;accent-color:#0072B2}
.pkv-viewer .pkv-step{font-variant-numeric:tabular-nums;min-width:10em}
.pkv-viewer .pkv-view{margin-top:10px}
.pkv-viewer .pkv-view-label{font-weight:600;margin-right:8px}
.pkv-viewer .pkv-headline{font-variant-numeric:tabular-nums}
.pkv-viewer .pkv-headline b{font-weight:600}
.pkv-viewer canvas{display:block;margin:6px 0 4px}
.pkv-viewer .pkv-note,.pkv-viewer .pkv-caption{font-size:12.5px;color:#57606a}
.pkv-viewer .pkv-legend{display:flex;flex-wrap:wrap;gap:2px 16px;font-size:12.5px;margin:2px 0}
.pkv-viewer .pkv-swatch{display:inline-block;width:24px;height:11px;margin-right:5px;vertical-align:-1px;
  box-sizing:border-box}
.pkv-viewer .pkv-status{font-size:12.5px;color:#9a6700;min-height:1em}
@media print{.pkv-viewer{display:none}}`;

  function injectStyle(doc) {
    if (doc.getElementById("pkv-style")) return;
    const style = doc.createElement("style");
    style.id = "pkv-style";
    style.textContent = CSS;
    doc.head.appendChild(style);
  }

  function element(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "text") node.textContent = v;
      else node.setAttribute(k, v);
    }
    for (const child of children || []) node.appendChild(child);
    return node;
  }

  function swatchStyle(entry) {
    const edge = entry.edge || entry.fill;
    if (entry.stripes) {
      const n = entry.stripes.length;
      const stops = entry.stripes.map((c, i) => `${c} ${(100 * i) / n}% ${(100 * (i + 1)) / n}%`);
      return `background:linear-gradient(90deg,${stops.join(",")})`;
    }
    if (entry.hatch && entry.hatch.includes("x")) {
      return `background:repeating-linear-gradient(45deg,${edge} 0 1.2px,transparent 1.2px 4px),`
        + `repeating-linear-gradient(135deg,${edge} 0 1.2px,${entry.fill} 1.2px 4px)`;
    }
    if (entry.hatch) {
      return `background:repeating-linear-gradient(135deg,${edge} 0 1.3px,${entry.fill} 1.3px 4px);`
        + `border:1px solid ${edge}`;
    }
    if (entry.edge) {
      return `background:${entry.fill};border:2px ${entry.dash ? "dashed" : "solid"} ${entry.edge}`;
    }
    return `background:${entry.fill}`;
  }

  function formatNumber(num, den, item) {
    if (item.percent) return den ? `${Math.round((100 * num) / den)}%` : "–";
    return num.toLocaleString("en-US");
  }

  class Viewer {
    constructor(el, model) {
      this.el = el;
      this.model = model;
      this.step = this.trace().start || 0;
      this.timer = null;
      this.values = {};
      for (const c of this.trace().controls) this.values[c.name] = c.value;
      injectStyle(el.ownerDocument);
      this.build();
      this.onTrace = () => this.update();
      this.onError = () => { this.status.textContent = model.get("error") || ""; };
      model.on("change:trace", this.onTrace);
      model.on("change:error", this.onError);
      this.width = 0;
      this.resize = typeof ResizeObserver === "function"
        ? new ResizeObserver(() => { if (this.root.clientWidth !== this.width) this.redraw(); })
        : null;
      if (this.resize) this.resize.observe(this.root);
      this.update();
    }

    /** The trace: an object on the site, JSON text from a kernel (parsed once). */
    trace() {
      const t = this.model.get("trace");
      if (typeof t !== "string") return t;
      if (t !== this.traceText) {
        this.traceText = t;
        this.parsed = JSON.parse(t);
      }
      return this.parsed;
    }

    build() {
      const t = this.trace();
      this.root = element("div", { class: "pkv-viewer pkv-mounted", "data-viewer": t.name });
      this.root.appendChild(element("div", { class: "pkv-title", text: t.title }));
      const controls = element("div", { class: "pkv-row pkv-controls" });
      this.selects = {};
      for (const c of t.controls) {
        const select = element("select", { "data-control": c.name, "aria-label": c.label });
        c.options.forEach((o) => {
          const option = element("option", { value: String(o), text: String(o) });
          if (String(o) === String(c.value)) option.selected = true;
          select.appendChild(option);
        });
        select.addEventListener("change", () => {
          this.values[c.name] = c.options.find((o) => String(o) === select.value);
          this.update();
        });
        this.selects[c.name] = select;
        controls.appendChild(element("label", {}, [document.createTextNode(c.label), select]));
      }
      this.root.appendChild(controls);
      const time = element("div", { class: "pkv-row pkv-time" });
      const button = (act, text, title) => {
        const b = element("button", { type: "button", "data-act": act, title, "aria-label": title, text });
        b.addEventListener("click", () => this.act(act));
        time.appendChild(b);
        return b;
      };
      button("first", "start", "back to the start");
      button("back", "◀", `one ${t.time} back`);
      this.playButton = button("play", "▶ play", "play");
      button("next", "▶", `one ${t.time} on`);
      const arrivals = t.views.some((v) => v.kind === "slots" || v.kind === "blocks");
      this.arrivalButton = arrivals ? button("arrival", "+ next request", "to the next request's arrival") : null;
      this.scrub = element("input", { type: "range", min: "0", max: "0", step: "1", value: "0",
        "aria-label": t.time, class: "pkv-scrub" });
      this.scrub.addEventListener("input", () => { this.pause(); this.go(Number(this.scrub.value)); });
      time.appendChild(this.scrub);
      this.stepLabel = element("span", { class: "pkv-step", "aria-live": "polite" });
      time.appendChild(this.stepLabel);
      this.root.appendChild(time);
      this.viewEls = t.views.map((v, i) => {
        const head = element("div", {}, [
          element("span", { class: "pkv-view-label", text: v.label }),
          element("span", { class: "pkv-headline" })]);
        const canvas = element("canvas", { role: "img", class: "pkv-canvas" });
        const legend = element("div", { class: "pkv-legend" }, v.legend.map((e) =>
          element("span", {}, [element("span", { class: "pkv-swatch", style: swatchStyle(e) }),
            document.createTextNode(e.label)])));
        const box = element("div", { class: "pkv-view", "data-view": String(i) },
          [head, canvas, element("div", { class: "pkv-note" }), legend]);
        this.root.appendChild(box);
        return box;
      });
      this.root.appendChild(element("div", { class: "pkv-caption", text: t.caption }));
      this.status = element("div", { class: "pkv-status", role: "status" });
      this.root.appendChild(this.status);
      this.el.replaceChildren(this.root);
    }

    /** The runs the current settings select (null where the trace lacks one). */
    runs() {
      return this.trace().views.map((v) => v.runs[runKey(v.params.map((p) => this.values[p]))] || null);
    }

    steps() {
      return Math.max(1, ...this.runs().filter(Boolean).map((r) => r.steps));
    }

    update() {
      const t = this.trace();
      const missing = t.views.map((v, i) => [i, v]).filter(([i]) => !this.runs()[i]);
      if (missing.length) { // keep the step and the drawing until the run arrives
        const [i, v] = missing[0];
        this.status.textContent = "computing this setting in the kernel…";
        this.model.set("wanted", `${i}|${runKey(v.params.map((p) => this.values[p]))}`);
        this.model.save_changes();
        return;
      }
      this.status.textContent = this.model.get("error") || "";
      this.scrub.max = String(this.steps() - 1);
      this.go(Math.min(this.step, this.steps() - 1));
    }

    go(step) {
      this.step = Math.max(0, Math.min(step, this.steps() - 1));
      this.scrub.value = String(this.step);
      this.root.dataset.step = String(this.step);
      this.stepLabel.textContent = `${this.trace().time} ${this.step.toLocaleString("en-US")} of `
        + `${(this.steps() - 1).toLocaleString("en-US")}`;
      this.redraw();
    }

    redraw() {
      const t = this.trace();
      const runs = this.runs();
      this.width = this.root.clientWidth;
      const width = Math.max(240, Math.min(900, (this.width || 700) - 26));
      t.views.forEach((view, i) => {
        const box = this.viewEls[i], run = runs[i];
        const canvas = box.querySelector("canvas");
        const line = box.querySelector(".pkv-headline");
        if (!run) {
          line.textContent = "…";
          return;
        }
        const state = replay(view, run, this.step);
        draw(canvas, width, view, run, state);
        line.replaceChildren(...view.headline.map((item, k) => {
          const [num, den] = headlineValue(item, view, run, state, this.step);
          const span = element("span", { "data-key": item.key, "data-num": String(num),
            "data-label": item.label }, [element("b", { text: formatNumber(num, den, item) }),
            document.createTextNode(" " + item.label + (k < view.headline.length - 1 ? " · " : ""))]);
          if (den !== null) span.setAttribute("data-den", String(den));
          return span;
        }));
        canvas.setAttribute("aria-label", `${view.label}: ${line.textContent}`);
        box.querySelector(".pkv-note").textContent = note(view, state);
      });
      if (this.arrivalButton) this.arrivalButton.disabled = this.nextArrival() === null;
    }

    nextArrival() {
      let best = null;
      this.trace().views.forEach((view, i) => {
        const run = this.runs()[i];
        if (!run || (view.kind !== "slots" && view.kind !== "blocks")) return;
        const arrivals = view.kind === "slots"
          ? run.requests.filter((_, k) => k % 8 === 0) : run.requests.map((r) => r[0]);
        for (const a of arrivals) if (a > this.step && (best === null || a < best)) best = a;
      });
      return best;
    }

    act(what) {
      if (what === "play") return this.timer ? this.pause() : this.play();
      this.pause();
      if (what === "first") this.go(0);
      if (what === "back") this.go(this.step - 1);
      if (what === "next") this.go(this.step + 1);
      if (what === "arrival" && this.nextArrival() !== null) this.go(this.nextArrival());
    }

    play() {
      const total = this.steps();
      if (this.step >= total - 1) this.go(0);
      const slow = total <= 60;
      const stride = slow ? 1 : Math.ceil(total / 400);
      this.playButton.textContent = "⏸ pause";
      this.timer = setInterval(() => {
        if (this.step >= this.steps() - 1) return this.pause();
        this.go(this.step + stride);
      }, slow ? 700 : 50);
    }

    pause() {
      if (this.timer) clearInterval(this.timer);
      this.timer = null;
      this.playButton.textContent = "▶ play";
    }

    destroy() {
      this.pause();
      if (this.resize) this.resize.disconnect();
      this.model.off("change:trace", this.onTrace);
      this.model.off("change:error", this.onError);
    }
  }

  /** A line under a pool: a paged pool's oldest running request's block table. */
  function note(view, state) {
    if (view.kind !== "blocks" || !state.tables.length) return "";
    const [rid, table] = state.tables.reduce((a, b) => (b[0] < a[0] ? b : a));
    const shown = table.slice(0, 16).join(", ") + (table.length > 16 ? ", …" : "");
    return `block table of request ${rid}, the oldest running: [${shown}]`;
  }

  /** A model for the site: the trace in the page, nothing to ask of a kernel. */
  function pageModel(trace) {
    return { get: (name) => (name === "trace" ? trace : ""), set() {}, save_changes() {},
      on() {}, off() {} };
  }

  function mount(el, trace) {
    const viewer = new Viewer(el, pageModel(trace));
    el.pkvViewer = viewer;
    return viewer;
  }

  /** Mount every viewer of the page that is not mounted yet. */
  function mountAll(root) {
    for (const el of (root || document).querySelectorAll(".pkv-viewer:not(.pkv-mounted)")) {
      const data = el.querySelector("script.pkv-trace");
      if (!data) continue;
      const host = document.createElement("div");
      el.replaceWith(host);
      mount(host, JSON.parse(data.textContent));
    }
  }

  /** anywidget's entry point (JupyterLab, Notebook, Colab). */
  function render({ model, el }) {
    const viewer = new Viewer(el, model);
    return () => viewer.destroy();
  }

  const api = { render, mount, mountAll, replay, headline, runKey, expand };
  globalThis.PagedKVViewer = api;
  if (typeof document !== "undefined" && document.currentScript) {
    if (document.readyState === "loading") {
      document.addEventListener("DOMContentLoaded", () => mountAll());
    } else {
      mountAll();
    }
  }
})();
