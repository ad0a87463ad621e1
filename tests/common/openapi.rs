//! Checks of OpenAPI documents against the official OpenAPI 3.1 JSON Schema, offline: a document
//! that a generator or a validator would refuse must fail a test here first.
//!
//! `openapi-3.1.schema.json` beside this file is `schemas/v3.1/schema.json` of the OpenAPI
//! Specification repository (the OpenAPI Initiative's, Apache-2.0), as published with the id
//! below, unchanged. It checks the structure of a document; the Schema Objects inside it are
//! checked by compiling them as JSON Schema 2020-12 ([`check_schema`]).

use serde_json::Value;

/// The OpenAPI 3.1 schema, as published.
pub const SCHEMA: &str = include_str!("openapi-3.1.schema.json");

/// Its `$id`.
const ID: &str = "https://spec.openapis.org/oas/3.1/schema/2022-10-07";

/// Whether `document` is a valid OpenAPI 3.1 document; the errors, when not.
pub fn validate(document: &Value) -> Result<(), String> {
    let schema: Value = serde_json::from_str(SCHEMA).map_err(|e| e.to_string())?;
    check(ID, schema, document)
}

/// Whether `instance` is valid against the JSON Schema (2020-12) `schema`; the errors, when not.
pub fn check_schema(schema: &Value, instance: &Value) -> Result<(), String> {
    let mut schema = schema.clone();
    if let Some(object) = schema.as_object_mut() {
        object.insert(
            "$schema".into(),
            "https://json-schema.org/draft/2020-12/schema".into(),
        );
    }
    check("urn:test:schema", schema, instance)
}

fn check(id: &str, schema: Value, instance: &Value) -> Result<(), String> {
    let mut schemas = boon::Schemas::new();
    let mut compiler = boon::Compiler::new();
    compiler
        .add_resource(id, schema)
        .map_err(|e| format!("{e:#}"))?;
    let index = compiler
        .compile(id, &mut schemas)
        .map_err(|e| format!("{e:#}"))?;
    schemas
        .validate(instance, index)
        .map_err(|e| format!("{e:#}"))
}
