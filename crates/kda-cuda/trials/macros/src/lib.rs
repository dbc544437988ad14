//! An attribute named `test` that keeps the function and registers it with `inventory` as
//! `kda_cuda_trials::Registered { name, run }`, instead of handing it to libtest (use it through
//! `kda_cuda_trials::test`).
//!
//! Why: `kda_testkit::conformance_tests!` expands to `#[test] fn name() { ... }`. A test target
//! with `harness = false` that brings this attribute into scope (`use kda_cuda_trials::test;`)
//! before invoking the macro collects every body as a trial, so it can report each one as
//! ignored, by name, when no CUDA device is present, rather than passing it silently. New
//! bodies added to the macro come along without a change here.

use proc_macro::{TokenStream, TokenTree};

/// Register `fn name() { ... }` as a trial named after its module path and `name`.
#[proc_macro_attribute]
pub fn test(attr: TokenStream, item: TokenStream) -> TokenStream {
    if !attr.is_empty() {
        return compile_error("#[test] as a kda-cuda trial takes no arguments");
    }
    let Some(name) = function_name(&item) else {
        return compile_error("#[test] as a kda-cuda trial applies to a function");
    };
    let registration = format!(
        "::kda_cuda_trials::inventory::submit! {{ ::kda_cuda_trials::Registered {{ \
         name: ::core::concat!(::core::module_path!(), \"::{name}\"), run: {name} }} }}"
    );
    let mut out = item;
    match registration.parse::<TokenStream>() {
        Ok(tokens) => out.extend(tokens),
        Err(e) => return compile_error(&format!("cannot register {name}: {e}")),
    }
    out
}

/// The identifier after the first `fn`.
fn function_name(item: &TokenStream) -> Option<String> {
    let mut after_fn = false;
    for token in item.clone() {
        match token {
            TokenTree::Ident(ident) => {
                let text = ident.to_string();
                if after_fn {
                    return Some(text);
                }
                after_fn = text == "fn";
            }
            _ => after_fn = false,
        }
    }
    None
}

fn compile_error(message: &str) -> TokenStream {
    format!("::core::compile_error!({message:?});").parse().unwrap_or_default()
}
