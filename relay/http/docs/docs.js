// Points Swagger UI at this relay's own document. A separate file, so the page's
// Content-Security-Policy needs no inline script.
window.addEventListener("load", function () {
  window.ui = SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#swagger-ui",
    deepLinking: true,
    // No badge fetched from the public validator: the page talks to this relay only.
    validatorUrl: null,
    // No ?url= / ?configUrl= from the address bar: the page shows this relay's API only.
    queryConfigEnabled: false,
    presets: [SwaggerUIBundle.presets.apis],
    layout: "BaseLayout",
  });
});
