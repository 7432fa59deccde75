// The experiment's plot: throughput and goodput against chunk size (two
// left axes), TTFT P99 and stall P99 on the right, the monolithic baseline
// as dashed flat lines. uPlot, fed from the JSON the live partial carries;
// redrawn after each htmx swap of that partial. Without JavaScript the
// results table has every figure.
(function () {
  var chart = null;
  window.chunkpilotExperimentPlot = function () { return chart; };

  function payload() {
    var src = document.getElementById("experiment-plot-data");
    return src ? JSON.parse(src.textContent) : null;
  }

  function flat(value, n) {
    var out = [];
    for (var i = 0; i < n; i++) out.push(value);
    return out;
  }

  function draw() {
    var el = document.getElementById("experiment-plot");
    var p = payload();
    if (!el || !p || typeof uPlot === "undefined") return;
    if (chart) { chart.destroy(); chart = null; }
    el.querySelectorAll(".empty-plot").forEach(function (n) { n.remove(); });
    if (!p.x.length) {
      el.insertAdjacentHTML("beforeend", '<p class="muted small empty-plot">No chunked arm measured yet.</p>');
      el.setAttribute("data-points", "0");
      return;
    }
    var n = p.x.length;
    var b = p.baseline || {};
    var ms = function (u, v) { return v == null ? "—" : (v * 1000).toFixed(0) + " ms"; };
    var series = [
      { label: "chunk size", value: function (u, v) { return v == null ? "—" : v; } },
      { label: "throughput (tok/s)", scale: "tok", stroke: "#2f5bd3", width: 2, points: { show: true } },
      { label: "goodput (req/s)", scale: "req", stroke: "#1c7c4a", width: 2, points: { show: true } },
      { label: "TTFT P99", scale: "s", stroke: "#d9480f", width: 1.5, value: ms, points: { show: true } },
      { label: "stall P99", scale: "s", stroke: "#9c36b5", width: 1.5, value: ms, points: { show: true } },
    ];
    var data = [p.x, p.output_throughput, p.goodput, p.ttft_p99, p.stall_p99];
    if (p.baseline) {
      series.push({ label: "baseline throughput", scale: "tok", stroke: "#2f5bd3", dash: [6, 4], width: 1 });
      series.push({ label: "baseline goodput", scale: "req", stroke: "#1c7c4a", dash: [6, 4], width: 1 });
      data.push(flat(b.output_throughput, n), flat(b.goodput, n));
    }
    if (p.predicted) {  // a verification: its prediction at the same chunk sizes
      var pb = p.predicted.baseline || {};
      series.push({ label: "predicted throughput", scale: "tok", stroke: "#2f5bd3", dash: [2, 3], width: 1.5, points: { show: true } });
      series.push({ label: "predicted goodput", scale: "req", stroke: "#1c7c4a", dash: [2, 3], width: 1.5, points: { show: true } });
      data.push(p.predicted.output_throughput, p.predicted.goodput);
      if (p.baseline) {
        series.push({ label: "predicted baseline goodput", scale: "req", stroke: "#1c7c4a", dash: [1, 5], width: 1 });
        data.push(flat(pb.goodput, n));
      }
    }
    // Each value axis comes with the data (dashboards/axes.py): from zero in
    // round steps, so a 1% gap between arms looks like 1%, not a cliff.
    var axes = p.axes || {};
    function scale(key) {
      var a = axes[key];
      return a ? { auto: false, range: function () { return [a.min, a.max]; } } : { auto: true };
    }
    function axis(key, opts) {
      var a = axes[key];
      if (!a) return opts;
      opts.splits = function () { return a.ticks.slice(); };
      opts.values = function (u, vals) {
        return vals.map(function (v) { var i = a.ticks.indexOf(v); return i < 0 ? String(v) : a.labels[i]; });
      };
      return opts;
    }
    var xScale = { time: false, distr: 3 };
    if (p.x_range) xScale.range = function () { return p.x_range.slice(); };
    chart = new uPlot({
      width: Math.max(320, el.clientWidth),
      height: 300,
      scales: { x: xScale, tok: scale("tok"), req: scale("req"), s: scale("s") },
      series: series,
      axes: [
        { label: "chunk size (tokens)", values: function (u, vals) { return vals.map(function (v) { return v; }); } },
        axis("tok", { scale: "tok", label: "tok/s" }),
        axis("req", { scale: "req", label: "req/s", side: 3, grid: { show: false } }),
        axis("s", { scale: "s", label: "TTFT, stall P99", side: 1, grid: { show: false } }),
      ],
    }, data, el);
    chart.axesPayload = axes;
    el.setAttribute("data-points", String(n));
  }

  document.addEventListener("DOMContentLoaded", draw);
  document.addEventListener("htmx:afterSettle", draw);
  document.addEventListener("htmx:oobAfterSwap", draw);
})();
