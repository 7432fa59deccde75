// Keeps "Ns ago" figures current between server renders. Without
// JavaScript the server-rendered age is shown instead.
(function () {
  function age(seconds) {
    if (seconds < 60) return Math.max(0, Math.floor(seconds)) + "s ago";
    if (seconds < 3600) return Math.floor(seconds / 60) + "m ago";
    if (seconds < 86400) return Math.floor(seconds / 3600) + "h ago";
    return Math.floor(seconds / 86400) + "d ago";
  }
  function tick() {
    var now = Date.now();
    document.querySelectorAll("time[data-age]").forEach(function (el) {
      var t = Date.parse(el.getAttribute("datetime"));
      if (!isNaN(t)) el.textContent = age((now - t) / 1000);
    });
  }
  setInterval(tick, 1000);
  document.addEventListener("DOMContentLoaded", tick);
  document.addEventListener("htmx:afterSettle", tick);
})();

// "Live updates paused" while any of the page's websockets is down for a
// reason the htmx ws extension reconnects on (abnormal closure, server
// error, restart, try again later: the control plane's store is away);
// hidden again once every one of them is open.
(function () {
  var RECONNECTS_ON = [1006, 1011, 1012, 1013];
  var down = new Set();
  // A dropped socket retries with full jitter, as htmx does, but capped at
  // 10 s instead of its 64 s: once a store is back, every open page is live
  // again within seconds, and a fleet of browsers still spreads its retries.
  if (window.htmx) htmx.config.wsReconnectDelay = function (retryCount) {
    return Math.min(10000, 1000 * Math.pow(2, retryCount)) * Math.random();
  };
  function show() {
    // A socket's element that left the page (swapped out) is not down.
    down.forEach(function (el) {
      if (!el.isConnected) down.delete(el);
    });
    var banner = document.getElementById("live-paused");
    if (banner) banner.hidden = down.size === 0;
  }
  document.addEventListener("htmx:afterSettle", show);
  document.addEventListener("htmx:wsClose", function (e) {
    var code = e.detail && e.detail.event ? e.detail.event.code : 1006;
    if (RECONNECTS_ON.indexOf(code) >= 0) down.add(e.target);
    show();
  });
  document.addEventListener("htmx:wsOpen", function (e) {
    down.delete(e.target);
    show();
  });
})();

// A form that a live push put on the page was rendered without a request,
// so its {% csrf_token %} is empty. Before any POST form is sent, it gets
// the page's own token (the body's hx-headers, which htmx requests send
// too); a form rendered with the page keeps the one it has.
(function () {
  function pageToken() {
    try {
      return JSON.parse(document.body.getAttribute("hx-headers") || "{}")["X-CSRFToken"] || "";
    } catch (e) {
      return "";
    }
  }
  document.addEventListener(
    "submit",
    function (e) {
      var form = e.target;
      if (!(form instanceof HTMLFormElement) || (form.getAttribute("method") || "").toLowerCase() !== "post") return;
      if (form.querySelector('input[name="csrfmiddlewaretoken"]')) return;
      var token = pageToken();
      if (!token) return;
      var input = document.createElement("input");
      input.type = "hidden";
      input.name = "csrfmiddlewaretoken";
      input.value = token;
      form.appendChild(input);
    },
    true
  );
})();
