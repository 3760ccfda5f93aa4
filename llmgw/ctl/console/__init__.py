"""`llmgw console`: the fleet and its whole history in a browser (docs/design.md, "The
console"). `views` shapes what the page shows (pure), `live` follows the log,
`server` serves the page and its JSON API."""
