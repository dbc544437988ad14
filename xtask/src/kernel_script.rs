//! `build_kernels.sh`: the one description of how kda's AscendC kernels are built with CANN —
//! where the toolkit and its compiler are, which release it is, which flags that release's own
//! cmake passes. `cargo xtask kernels` writes it and runs it; the npu-check bundle carries it.
//! The script is `build_kernels.sh.in` with the lists below filled in, so each list is written
//! once, here, next to the CANN source it follows.

/// The variables CANN's `set_env.sh` exports, in the order they are trusted.
pub(crate) const TOOLKIT_VARS: [&str; 3] =
    ["ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "ASCEND_CANN_PACKAGE_PATH"];

/// Where CANN installs when no variable is set: `/usr/local/Ascend/cann` from 8.5 on (the
/// layout of CANN's install guide), `/usr/local/Ascend/ascend-toolkit/latest` before, and the
/// same under `$HOME/Ascend` for a non-root install.
pub(crate) const DEFAULT_ROOTS: [&str; 4] = [
    "/usr/local/Ascend/cann",
    "/usr/local/Ascend/ascend-toolkit/latest",
    "$HOME/Ascend/cann",
    "$HOME/Ascend/ascend-toolkit/latest",
];

/// The binary's name, which the backend looks for (`ascend-kernels/kda_kernels.o`).
pub(crate) const BINARY: &str = "kda_kernels.o";

/// A2/A3 (Ascend 910B / 910_93); `KDA_ASCEND_NPU_ARCH=dav-3510` for the 950.
pub(crate) const DEFAULT_ARCH: &str = "dav-2201";

/// The include directories of asc-devkit `cmake/asc/legacy_modules/bisheng_intf.cmake`
/// (`device_intf_pub`), relative to the devkit directory the compiler was found in.
const DEVKIT_INCLUDES: [&str; 18] = [
    "asc/impl/adv_api",
    "asc/impl/basic_api",
    "asc/impl/c_api",
    "asc/impl/basic_api/reg_compute",
    "asc/impl/simt_api",
    "asc/impl/utils",
    "asc",
    "asc/include",
    "asc/include/adv_api",
    "asc/include/basic_api",
    "asc/include/aicpu_api",
    "asc/include/c_api",
    "asc/include/basic_api/reg_compute",
    "asc/include/simt_api",
    "asc/include/utils",
    "tikcpp/tikcfw",
    "tikcpp/tikcfw/interface",
    "tikcpp/tikcfw/impl",
];

/// `device_intf_pub`'s options (bisheng_intf.cmake): every legacy-style device compile.
const CCE_COMMON: [&str; 4] = ["-O3", "-std=c++17", "--cce-aicore-lang", "-DTILING_KEY_VAR=0"];

/// `c220_aiv_intf_pub` (bisheng_intf.cmake): vector-only kernels on A2/A3.
const CCE_C220_VEC: [&str; 13] = [
    "--cce-aicore-arch=dav-c220-vec",
    "--cce-aicore-only",
    "--cce-auto-sync",
    "-mllvm",
    "-cce-aicore-stack-size=0x8000",
    "-mllvm",
    "-cce-aicore-function-stack-size=0x8000",
    "-mllvm",
    "-cce-aicore-record-overflow=true",
    "-mllvm",
    "-cce-aicore-addr-transform",
    "-mllvm",
    "-cce-aicore-dcci-insert-for-scalar=false",
];

/// `c310_aiv_intf_pub` (bisheng_intf.cmake, from CANN 9.0): vector-only kernels on the 950.
const CCE_C310_VEC: [&str; 17] = [
    "-D__DAV_C310__",
    "--cce-aicore-arch=dav-c310-vec",
    "--cce-aicore-only",
    "--cce-auto-sync",
    "--cce-mask-opt",
    "-mllvm",
    "-cce-aicore-stack-size=0x8000",
    "-mllvm",
    "-cce-aicore-function-stack-size=0x8000",
    "-mllvm",
    "-cce-aicore-record-overflow=true",
    "-mllvm",
    "-cce-aicore-addr-transform",
    "-mllvm",
    "-cce-aicore-jump-expand=true",
    "-mllvm",
    "-cce-aicore-dcci-insert-for-scalar=false",
];

/// The ASC language style of CANN 9.x (asc-devkit `cmake/asc/asc_modules/
/// CMakeASCInformation.cmake`: `--npu-arch=<arch>`; `FindASC.cmake`'s
/// `ascendc_fatbin_library`: a device-only compile of each source).
const ASC_FLAGS: [&str; 4] = ["--npu-arch=\"$ARCH\"", "-O2", "-std=c++17", "--cce-auto-sync"];
const ASC_BEFORE_SOURCE: [&str; 1] = ["--asc-aicore-lang"];
const ASC_AFTER_SOURCE: [&str; 1] = ["--aicore-only"];

/// The script for `sources` (file names, relative to the source directory it is given).
pub(crate) fn script(sources: &[String]) -> String {
    let words = |list: &[&str]| list.join(" ");
    let quoted = |list: &[&str]| list.iter().map(|s| format!("\"{s}\"")).collect::<Vec<_>>();
    let includes: Vec<String> =
        DEVKIT_INCLUDES.iter().map(|d| format!("\"-I$DEVKIT/{d}\"")).collect();
    let sources: Vec<String> =
        sources.iter().map(|s| format!("'{}'", s.replace('\'', ""))).collect();
    include_str!("build_kernels.sh.in")
        .replace("@DEFAULT_ARCH@", DEFAULT_ARCH)
        .replace("@SOURCES@", &sources.join(" "))
        .replace("@TOOLKIT_VARS@", &words(&TOOLKIT_VARS))
        .replace("@DEFAULT_ROOTS_TEXT@", &DEFAULT_ROOTS.join(", "))
        .replace("@DEFAULT_ROOTS@", &quoted(&DEFAULT_ROOTS).join(" "))
        .replace("@DEVKIT_INCLUDES@", &includes.join(" "))
        .replace("@CCE_COMMON@", &words(&CCE_COMMON))
        .replace("@CCE_C220_VEC@", &words(&CCE_C220_VEC))
        .replace("@CCE_C310_VEC@", &words(&CCE_C310_VEC))
        .replace("@ASC_FLAGS@", &words(&ASC_FLAGS))
        .replace("@ASC_BEFORE_SOURCE@", &words(&ASC_BEFORE_SOURCE))
        .replace("@ASC_AFTER_SOURCE@", &words(&ASC_AFTER_SOURCE))
        .replace("@BINARY@", BINARY)
}

/// The script's exit status when there is no toolkit or no compiler (nothing was compiled).
pub(crate) const NO_TOOLKIT: i32 = 2;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    /// A fresh directory under the system temp directory (removed first if a previous run left it).
    pub(crate) fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kda-xtask-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        dir
    }

    pub(crate) fn write_exe(path: &Path, text: &str) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("its directory");
        std::fs::write(path, text).expect("written");
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }

    /// A fake CANN tree: `bisheng` and `ld.lld` under `<root>/<dir>/ccec_compiler/bin` record
    /// their arguments in `<root>/calls.log` and create their `-o` output; `fail` makes
    /// bisheng print a compiler error and exit 1.
    pub(crate) fn fake_cann(root: &Path, dir: &str, version: &str, fail: bool) {
        let record = format!(
            "#!/usr/bin/env bash\necho \"$(basename \"$0\") $*\" >> '{}'\n",
            root.join("calls.log").display()
        );
        let make_output = "while [ $# -gt 0 ]; do if [ \"$1\" = -o ]; then : > \"$2\"; fi; \
                           shift; done\n";
        let bin = root.join(dir).join("ccec_compiler/bin");
        let bisheng = if fail {
            format!(
                "{record}echo \"kda_gate.cpp:12:3: error: use of undeclared identifier \
                 'Frobnicate'\" >&2\nexit 1\n"
            )
        } else {
            format!("{record}{make_output}")
        };
        write_exe(&bin.join("bisheng"), &bisheng);
        write_exe(&bin.join("ld.lld"), &format!("{record}{make_output}"));
        let info = root.join(format!("{}-linux", std::env::consts::ARCH));
        std::fs::create_dir_all(&info).expect("the info directory");
        std::fs::write(info.join("ascend_toolkit_install.info"), format!("version={version}\n"))
            .expect("the install record");
    }

    fn run(script_dir: &Path, root: &Path, extra: &[(&str, &str)]) -> (i32, String) {
        let src = script_dir.join("src");
        std::fs::create_dir_all(&src).expect("src");
        for s in ["kda_gate.cpp", "kda_sigmoid.cpp"] {
            std::fs::write(src.join(s), "// a kernel\n").expect("a source");
        }
        let path = script_dir.join("build_kernels.sh");
        write_exe(&path, &script(&["kda_gate.cpp".into(), "kda_sigmoid.cpp".into()]));
        let mut cmd = Command::new("bash");
        cmd.arg(&path).arg(&src).arg(script_dir.join("out"));
        for v in
            TOOLKIT_VARS.iter().chain(["KDA_ASCEND_NPU_ARCH", "KDA_ASCEND_KERNEL_STYLE"].iter())
        {
            cmd.env_remove(v);
        }
        cmd.env("ASCEND_HOME_PATH", root).env("PATH", "/usr/bin:/bin");
        for (k, v) in extra {
            cmd.env(k, v);
        }
        let out = cmd.output().expect("bash runs");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code().unwrap_or(-1), text)
    }

    /// The compiler under `<arch>-linux` wins over `tools/` (asc-devkit's order), CANN 8.5 gets
    /// bisheng_intf.cmake's c220 vector flags and include directories, and the link follows.
    #[test]
    fn a_fake_cann_85_tree_is_found_under_the_arch_dir_with_the_legacy_flags() {
        let dir = scratch("cann85");
        let root = dir.join("cann");
        let arch_dir = format!("{}-linux", std::env::consts::ARCH);
        fake_cann(&root, "tools", "8.5.0", true);
        fake_cann(&root, &arch_dir, "8.5.0", false);
        let (code, text) = run(&dir, &root, &[]);
        assert_eq!(code, 0, "{text}");
        let calls = std::fs::read_to_string(root.join("calls.log")).expect("the calls");
        let lines: Vec<&str> = calls.lines().collect();
        assert_eq!(lines.len(), 3, "{calls}");
        let devkit = root.join(&arch_dir).display().to_string();
        assert!(text.contains(&format!("compiler {devkit}/ccec_compiler/bin/bisheng")), "{text}");
        let compile = lines[0];
        assert!(
            compile.starts_with(
                "bisheng -O3 -std=c++17 --cce-aicore-lang -DTILING_KEY_VAR=0 \
             --cce-aicore-arch=dav-c220-vec --cce-aicore-only --cce-auto-sync -mllvm \
             -cce-aicore-stack-size=0x8000"
            ),
            "{compile}"
        );
        assert!(compile.contains(&format!("-I{devkit}/asc/include/basic_api")), "{compile}");
        assert!(compile.contains(&format!("-I{devkit}/tikcpp/tikcfw/impl")), "{compile}");
        assert!(compile.ends_with(&format!(
            "-o {0}/out/kda_gate.device.o -c {0}/src/kda_gate.cpp",
            dir.display()
        )));
        assert!(!compile.contains("--npu-arch"));
        assert_eq!(
            lines[2],
            format!(
                "ld.lld -m aicorelinux -Ttext=0 {0}/out/kda_gate.device.o \
                 {0}/out/kda_sigmoid.device.o -static -o {0}/out/kda_kernels.o",
                dir.display()
            )
        );
        // The 950 needs the c310 interface, which CANN 8.5's bisheng_intf.cmake lacks.
        let (code, text) = run(&dir, &root, &[("KDA_ASCEND_NPU_ARCH", "dav-3510")]);
        assert_eq!(code, NO_TOOLKIT, "{text}");
        assert!(text.contains("dav-3510 (Ascend 950) needs CANN 9.0"), "{text}");
    }

    /// CANN 9.x: the ASC language flags; the toolchain found under `tools/` when that is all
    /// there is; `cce` still selectable, with the 950's c310 interface.
    #[test]
    fn a_fake_cann_9_tree_under_tools_uses_npu_arch() {
        let dir = scratch("cann9");
        let root = dir.join("cann");
        fake_cann(&root, "tools", "9.0.0", false);
        let (code, text) = run(&dir, &root, &[("KDA_ASCEND_NPU_ARCH", "dav-3510")]);
        assert_eq!(code, 0, "{text}");
        let calls = std::fs::read_to_string(root.join("calls.log")).expect("the calls");
        let first = calls.lines().next().unwrap_or_default();
        assert!(first.starts_with("bisheng --npu-arch=dav-3510 -O2 -std=c++17 --cce-auto-sync"));
        assert!(first.contains(&format!("-I{}/tools/asc/include", root.display())), "{first}");
        assert!(first.ends_with(&format!(
            "-c --asc-aicore-lang {}/src/kda_gate.cpp --aicore-only",
            dir.display()
        )));
        let (code, text) = run(
            &dir,
            &root,
            &[("KDA_ASCEND_NPU_ARCH", "dav-3510"), ("KDA_ASCEND_KERNEL_STYLE", "cce")],
        );
        assert_eq!(code, 0, "{text}");
        assert!(text.contains("-D__DAV_C310__ --cce-aicore-arch=dav-c310-vec"), "{text}");
    }

    #[test]
    fn no_toolkit_or_no_compiler_exits_2_naming_what_was_tried() {
        let dir = scratch("nocann");
        let root = dir.join("empty");
        std::fs::create_dir_all(&root).expect("root");
        let (code, text) = run(&dir, &root, &[]);
        assert_eq!(code, NO_TOOLKIT, "{text}");
        assert!(text.contains("tools/ccec_compiler/bin/bisheng"), "{text}");
        assert!(text.contains("compiler/ccec_compiler/bin/bisheng"), "{text}");
    }
}
