//! With the `collective` feature (which links libtorch), embeds libtorch's library folder as an
//! rpath so that the plugin and its tests load without LD_LIBRARY_PATH.
fn main() {
    // Exported by torch-sys through its `links = "tch"` key; absent without the feature.
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    }
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
}
